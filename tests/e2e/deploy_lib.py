"""Readers for deploy/: the Dockerfile's instructions, the YAML manifests, attnd's flag names."""
import json
import os
import re
import shlex

from e2e_lib import REPO, check, require_yaml, run

DEPLOY = os.path.join(REPO, "deploy")


def dockerfile_instructions(path=os.path.join(DEPLOY, "Dockerfile")):
    """[(stage_index, INSTRUCTION, arguments)], continuation lines joined, comments dropped."""
    instructions, stage, pending = [], -1, ""
    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#"):
                continue  # a comment inside a continued instruction
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = pending + line, ""
            keyword, _, arguments = line.strip().partition(" ")
            keyword = keyword.upper()
            if keyword == "FROM":
                stage += 1
            instructions.append((stage, keyword, arguments.strip()))
    check(not pending, f"{path} ends inside a continued line")
    return instructions


def exec_form(arguments, what):
    """A JSON-array (exec form) argument list, e.g. CMD ["a", "b"]."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    check(isinstance(value, list) and all(isinstance(v, str) for v in value),
          f"{what} is not in exec form (a JSON array of strings): {arguments}")
    return value


def healthcheck_command(instructions):
    checks = [(s, a) for s, k, a in instructions if k == "HEALTHCHECK"]
    check(len(checks) == 1, f"expected one HEALTHCHECK, found {len(checks)}")
    arguments = checks[0][1]
    options, _, command = arguments.partition("CMD")
    check(command, f"HEALTHCHECK has no CMD: {arguments}")
    return exec_form(command.strip(), "HEALTHCHECK CMD"), shlex.split(options)


def load_yaml_documents(path):
    yaml = require_yaml()
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def attnd_flag_names(attnd):
    """Flags attnd accepts, from --helpfull (absl prints '--name (help)' lines)."""
    result = run([attnd, "--helpfull"], check_exit=False)
    names = set(re.findall(r"^\s+--([a-z0-9_]+) ", result.stdout + result.stderr, re.M))
    check("listen_address" in names, f"attnd --helpfull lists no --listen_address:\n"
                                      f"{result.stdout[:2000]}")
    return names


def check_flags(arguments, known, where):
    """Every --flag[=value] in arguments is one attnd knows (dashes accepted like attnd does)."""
    for argument in arguments:
        if argument.startswith("--"):
            name = argument[2:].split("=", 1)[0].replace("-", "_")
            check(name in known, f"{where}: attnd has no flag --{name}")


def flag_value(arguments, name):
    values = [a.split("=", 1)[1] for a in arguments if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def port_of(address):
    return int(address.rsplit(":", 1)[1])
