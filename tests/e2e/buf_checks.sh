#!/usr/bin/env bash
# buf lint and buf breaking on proto/ (configuration: proto/buf.yaml).
#   buf_checks.sh BUF lint       lint proto/ (rules and the documented exceptions in buf.yaml)
#   buf_checks.sh BUF breaking   compare proto/ with the newest release tag v*; exits 77
#                                (ctest's skip) with a message when no such tag exists yet
set -euo pipefail
buf=$1
mode=$2
cd "$(dirname "$0")/../.."
if [[ ! -x $buf ]]; then
  echo "E2E TEST SKIPPED: buf is not installed at $buf (tests/e2e/setup-tools.sh)" >&2
  [[ ${CI:-} == true ]] && exit 1
  exit 77
fi
case $mode in
  lint)
    "$buf" lint proto
    echo "PASS buf lint proto ($("$buf" --version), STANDARD rules, exceptions in proto/buf.yaml)"
    ;;
  breaking)
    tag=$(git tag --list 'v*' --sort=-version:refname 2>/dev/null | head -n 1 || true)
    if [[ -z $tag ]]; then
      echo "SKIPPED buf breaking: no release tag v* in this clone, nothing to compare against"
      exit 77
    fi
    "$buf" breaking proto --against ".git#tag=$tag,subdir=proto"
    echo "PASS buf breaking: proto/ is compatible with $tag (FILE rules)"
    ;;
  *)
    echo "usage: $0 BUF lint|breaking" >&2
    exit 2
    ;;
esac
