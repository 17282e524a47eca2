"""ctest's entry to the Python client's tests: checks the interpreter has what they need, then
runs pytest on the given files with the built attnd.

    run_tests.py --attnd BUILD/server/attnd [--need-torch] test_a.py ...

Exits 77 (ctest's SKIP_RETURN_CODE) when a Debian package is missing outside CI, and fails
under CI=true, where scripts/install-deps.sh must have installed it.
"""
import argparse
import importlib
import os
import sys

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = {"pytest": "python3-pytest", "grpc": "python3-grpcio",
            "google.protobuf": "python3-protobuf", "numpy": "python3-numpy"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--attnd", required=True)
    parser.add_argument("--need-torch", action="store_true")
    parser.add_argument("tests", nargs="+")
    args = parser.parse_args()
    needed = dict(PACKAGES)
    if args.need_torch:
        needed["torch"] = "python3-torch"
    missing = []
    for module, package in needed.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        in_ci = os.environ.get("CI") == "true"
        print(f"{'FAILED' if in_ci else 'SKIPPED'}: {sys.executable} lacks "
              f"{', '.join(missing)} (scripts/install-deps.sh installs them)", flush=True)
        return 1 if in_ci else SKIP
    import pytest
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", HERE,
                        f"--attnd={args.attnd}", "-rs",
                        *[os.path.join(HERE, test) for test in args.tests]])


if __name__ == "__main__":
    sys.exit(main())
