"""Experiment scripts' ``--quick`` runs, one after the other in this one process (tests/test_bench_smoke.py).

    python tests/scripts/experiments_quick.py OUT_DIR SUMMARY_JSON "bench_x --repeats 1" "bench_y" ...

Each argument names a script in experiments/ and the arguments it gets besides ``--quick --out-dir
OUT_DIR/<script>``; its ``main(argv)`` runs here. Run as separate processes, every script would pay
its own imports of torch and Lightning and start its own forkserver (the server its ranks fork from,
experiments/_harness.py); here they pay them once. Every script runs, whatever an earlier one did;
SUMMARY_JSON gets, per script, its seconds and, if it failed, its traceback (which holds a failed
rank's or child's own traceback: ``_harness.ChildFailed``); OUT_DIR/<script>/stdout.txt what it
printed. Exit code 0.
"""

import contextlib
import importlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


class Tee(io.TextIOBase):
    """This process's stdout, also written to a file (a script's own lines; its ranks write to fd 1)."""

    def __init__(self, stream: Any, file: Any) -> None:
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()


def run(name: str, argv: list[str], out_dir: Path) -> dict:
    environ, cwd = dict(os.environ), os.getcwd()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        with open(out_dir / "stdout.txt", "w") as f, contextlib.redirect_stdout(Tee(sys.stdout, f)):
            code = importlib.import_module(name).main(argv)
        error = None if not code else f"main() returned {code}"
    except SystemExit as exit_:  # argparse's errors, or a script's raise SystemExit(message)
        error = None if not exit_.code else f"SystemExit: {exit_.code}\n{traceback.format_exc()}"
    except BaseException:
        error = traceback.format_exc()
    finally:  # what one script changed in the environment is not the next one's
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    return {"seconds": round(time.perf_counter() - start, 1), "error": error}


def main() -> None:
    out_dir, summary_path, *scripts = sys.argv[1:]
    sys.path.insert(0, str(EXPERIMENTS))  # as `python experiments/x.py` has it (the ranks get it too)
    summary = {}
    for spec in scripts:
        name, *extra = spec.split()
        script_dir = Path(out_dir) / name
        summary[name] = run(name, ["--quick", "--out-dir", str(script_dir), *extra], script_dir)
        status = "ok" if summary[name]["error"] is None else "FAILED"
        print(f"experiments_quick: {name} {status} in {summary[name]['seconds']} s", flush=True)
        Path(summary_path).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
