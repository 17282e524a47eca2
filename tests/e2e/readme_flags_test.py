#!/usr/bin/env python3
"""The README's flag table lists every flag of server/main.cc, with the default attnd really
has, and no flag attnd lacks. When this fails after a flag was added or changed in
server/main.cc, update the table in README.md ("Flags")."""
import os
import re

import e2e_lib
from e2e_lib import REPO, check, passed, run


def attnd_main_flags(attnd):
    """{name: default} of the flags `attnd --helpfull` lists under server/main.cc."""
    help_text = run([attnd, "--helpfull"], check_exit=False).stdout
    match = re.search(r"Flags from \S*server/main\.cc:\n(.*?)(?:\n\s*\n|\n\s*Flags from)",
                      help_text + "\n\n", re.S)
    check(match, "attnd --helpfull has no section for server/main.cc")
    flags = {}
    # Entries start with "    --name (help...); default: VALUE;" and may wrap; the help text
    # itself may say "(default: ...)", so the entry's last "default: " is the real one.
    for entry in re.split(r"\n(?=\s{4}--)", match.group(1)):
        name = re.match(r"\s*--([a-z0-9_]+) ", entry)
        if name:
            flags[name.group(1)] = entry.rsplit("default: ", 1)[1].strip().rstrip(";")
    check(flags, "attnd --helpfull lists no flags of server/main.cc")
    return flags


def unquote(value):
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


def test(work_dir):
    args = e2e_lib.parse_args()
    defaults = attnd_main_flags(args.attnd)
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    rows = dict(re.findall(r"^\| `--([a-z0-9_]+)` \| `([^`]*)` \|", readme, re.M))
    missing = sorted(set(defaults) - set(rows))
    check(not missing, f"README.md's flag table has no row for {', '.join('--' + m for m in missing)}"
                       " (server/main.cc has them): add them to README.md \"Flags\"")
    for name, default in defaults.items():
        check(unquote(rows[name]) == unquote(default),
              f"README.md says --{name} defaults to `{rows[name]}`, attnd says {default}")
    extra = sorted(set(rows) - set(defaults))
    check(not extra, f"README.md's flag table lists flags attnd does not have: {extra}")
    passed(f"README flag table matches attnd --helpfull ({len(defaults)} flags and defaults)")


if __name__ == "__main__":
    e2e_lib.main(test)
