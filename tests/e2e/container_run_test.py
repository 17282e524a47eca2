#!/usr/bin/env python3
"""The image's run half without a Docker engine: deploy/stage-runtime.sh (what the Dockerfile's
build stage runs) stages attnd, attnctl and their libraries; the staged attnd is started with
the Dockerfile's own ENTRYPOINT + CMD from the staged libraries in an emptied environment, and
the Dockerfile's HEALTHCHECK command, run as written, exits 0 while serving and non-zero while
draining (readiness NOT_SERVING), while liveness ("" service) stays SERVING until exit."""
import os
import subprocess

import e2e_lib
from deploy_lib import dockerfile_instructions, exec_form, healthcheck_command
from e2e_lib import REPO, Attnd, Buf, check, passed, run, wait_until

SERVICE = "attnd.v1.AttentionService"
# Loaded from the base image (glibc) or the host's driver; see deploy/stage-runtime.sh.
PROVIDED = ("linux-vdso.so", "ld-linux", "libc.so", "libm.so", "libdl.so", "libpthread.so",
            "librt.so", "libresolv.so", "libutil.so", "libcuda.so", "libnvidia-")


def test(work_dir):
    args = e2e_lib.parse_args()
    buf = Buf(args.tools)
    stage = os.path.join(work_dir, "stage")
    run([os.path.join(REPO, "deploy", "stage-runtime.sh"), args.build_dir, stage])
    binaries = [os.path.join(stage, "bin", name) for name in ("attnd", "attnctl")]
    libs = sorted(os.listdir(os.path.join(stage, "lib")))
    check(libs, "stage-runtime.sh staged no library")
    check(not any(lib.startswith(("libcuda.so", "libnvidia-", "libc.so")) for lib in libs),
          f"stage-runtime.sh staged a driver or C library: {libs}")

    # With LD_LIBRARY_PATH = the staged lib/ (as the image sets it), every library that the
    # base image does not provide must resolve inside the stage.
    env = {"PATH": f"{stage}/bin:/usr/bin:/bin", "LD_LIBRARY_PATH": f"{stage}/lib"}
    ldd = run(["ldd", *binaries], env=env).stdout
    for line in ldd.splitlines():
        if "=>" not in line:
            continue
        name, _, rest = line.strip().partition(" => ")
        check("not found" not in rest, f"staged binaries miss {name}")
        if not name.startswith(PROVIDED):
            check(rest.startswith(f"{stage}/lib/"), f"{name} resolves outside the stage: {rest}")
    passed(f"deploy/stage-runtime.sh staged 2 binaries and {len(libs)} libraries; all resolve "
           "inside the stage")

    instructions = dockerfile_instructions()
    final = [(k, a) for s, k, a in instructions if s == max(s for s, _, _ in instructions)]
    entrypoint = exec_form(next(a for k, a in final if k == "ENTRYPOINT"), "ENTRYPOINT")
    cmd = exec_form(next(a for k, a in final if k == "CMD"), "CMD")
    healthcheck, _ = healthcheck_command(instructions)
    # The image's command line, run from the stage; loopback ports replace 0.0.0.0:50051/9400
    # (later flags win), and a short drain so the drain check below stays quick.
    argv = [os.path.join(stage, "bin", entrypoint[0]), *entrypoint[1:], *cmd,
            "--kv_memory_bytes=268435456", "--drain_grace=20s"]
    attnd = Attnd(None, binaries[1], work_dir, env=env, argv_prefix=argv).start()
    info = run([binaries[1], "info", f"--server={attnd.address}"], env=env).stdout
    check("cpu" in info, f"the image's CMD (--backend=auto) without a GPU should serve on the "
                         f"CPU backend; attnctl info says:\n{info}")

    def image_healthcheck():
        command = [a if not a.startswith("--server=") else f"--server={attnd.address}"
                   for a in healthcheck]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)

    serving = image_healthcheck()
    check(serving.returncode == 0 and serving.stdout.strip() == "SERVING",
          f"HEALTHCHECK while serving: exit {serving.returncode}, {serving.stdout}{serving.stderr}")
    passed(f"the Dockerfile's ENTRYPOINT+CMD runs from the stage (env emptied); HEALTHCHECK "
           f"`{' '.join(healthcheck)}` exits 0: SERVING")

    # Hold a step open so SIGTERM leaves attnd draining for a while.
    url = f"http://{attnd.address}/{SERVICE}"
    buf.curl(f"{url}/CreateCache", {"name": "drain", "config": {
        "numLayers": 1, "numQoHeads": 1, "numKvHeads": 1, "headDim": 64, "numPages": "4"}})
    plan = buf.curl(f"{url}/Plan", {"cache": "drain", "entries": [
        {"sequenceId": "1", "numNewTokens": 1}]})
    attnd.process.terminate()
    draining = wait_until(lambda: (lambda r: r if r.returncode != 0 else None)(image_healthcheck()),
                          10, "HEALTHCHECK to fail after SIGTERM")
    check("NOT_SERVING" in draining.stdout,
          f"HEALTHCHECK while draining: {draining.stdout}{draining.stderr}")
    live = run([binaries[1], "health", "--service=", f"--server={attnd.address}"], env=env,
               check_exit=False)
    check(live.returncode == 0 and live.stdout.strip() == "SERVING",
          f"liveness while draining: exit {live.returncode} {live.stdout}{live.stderr}")
    check(attnd.process.poll() is None, "attnd exited while a step was still open")
    passed(f"after SIGTERM with a step open: HEALTHCHECK exits {draining.returncode} "
           f"(NOT_SERVING), liveness '' stays SERVING")
    ended = buf.curl(f"{url}/EndStep", {"stepId": plan["stepId"], "abort": True})
    check(ended.get("outcome") == "STEP_OUTCOME_ABORTED", f"EndStep abort while draining: {ended}")
    try:
        code = attnd.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        code = None
    check(code == 0, f"attnd did not exit 0 within 15 s of its last step ending (exit {code})")
    passed("the last step ended, attnd drained and exited 0")


if __name__ == "__main__":
    e2e_lib.main(test)
