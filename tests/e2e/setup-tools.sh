#!/usr/bin/env bash
# Installs the e2e tests' tools that Debian does not package into a project-local directory:
# buf (npm package @bufbuild/buf, pinned), under TOOLS_DIR/node_modules/.bin/buf.
# Cached: a second run with the same pinned version does nothing (npm's own cache makes a
# reinstall into a fresh build tree take seconds).
# Usage: tests/e2e/setup-tools.sh TOOLS_DIR
# Exit 0 when installed; 77 (ctest's skip) when npm is missing or the install fails outside CI;
# 1 when it fails under CI=true, where the e2e tests must run.
set -euo pipefail
tools_dir=${1:?usage: $0 TOOLS_DIR}
buf_version=1.75.0

fail_or_skip() {
  echo "=====================================================================" >&2
  echo "E2E TOOLS NOT INSTALLED: $*" >&2
  echo "The e2e tests that need buf will be SKIPPED (scripts/test.sh installs npm" >&2
  echo "with ATTND_E2E_DEPS=1)." >&2
  echo "=====================================================================" >&2
  if [[ ${CI:-} == true ]]; then exit 1; fi
  exit 77
}

buf=$tools_dir/node_modules/.bin/buf
if [[ -x $buf ]] && [[ $("$buf" --version 2>/dev/null) == "$buf_version" ]]; then
  echo "setup-tools: buf $buf_version already in $tools_dir"
  exit 0
fi
command -v npm >/dev/null || fail_or_skip "npm is not installed"
mkdir -p "$tools_dir"
# A package.json of our own so npm installs here and not in a parent directory's project.
if [[ ! -f $tools_dir/package.json ]]; then
  printf '{ "name": "attnd-e2e-tools", "private": true }\n' >"$tools_dir/package.json"
fi
# The platform binary comes as an optional dependency (@bufbuild/buf-linux-x64); no
# install script is needed to find it.
if ! timeout 300 npm install --prefix "$tools_dir" --no-audit --no-fund --loglevel=error \
    --save-exact "@bufbuild/buf@$buf_version" >&2; then
  fail_or_skip "npm install @bufbuild/buf@$buf_version failed"
fi
version=$("$buf" --version 2>&1) || fail_or_skip "buf does not run: $version"
[[ $version == "$buf_version" ]] || fail_or_skip "buf --version says '$version', expected $buf_version"
echo "setup-tools: installed buf $version in $tools_dir"
