"""``python -m gemslib``: print the environment, check every operator, time it on a GPU.

``python -m gemslib demo``: Llama-3-8B-shaped decoder layers run five ways, then (with
transformers installed) transformers' LlamaForCausalLM eager and compiled with the gemslib
backend (gemslib/demo.py; ``python -m gemslib demo --help`` lists its options).

Checks each operator's self-checks (declared in its file as ``SELF_CHECKS``) against a float64
reference on fresh random inputs, in every dtype the check lists, and exits 1 on any mismatch.
On a GPU it also times gemslib against what a user would call without it (torch). On a machine
without a GPU it re-runs itself under the Triton interpreter.

Exit codes: 0 every check passed, 1 a check failed, 2 bad arguments (argparse's usage error).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gemslib.cli import doc_summary, positive_int


def _reexec_under_interpreter(argv: list[str]) -> None:
    print("no CUDA GPU found: running the kernels in the Triton interpreter (TRITON_INTERPRET=1)",
          flush=True)
    env = dict(os.environ, TRITON_INTERPRET="1")
    os.execve(sys.executable, [sys.executable, "-m", "gemslib", *argv], env)


def describe_environment() -> list[str]:
    import torch
    import triton

    import gemslib
    from gemslib import runtime

    lines = [f"gemslib {gemslib.__version__} | torch {torch.__version__} | triton {triton.__version__}"
             f" | python {sys.version.split()[0]}"]
    if runtime.INTERPRETER:
        lines.append("backend: Triton interpreter on the CPU (TRITON_INTERPRET=1)")
    else:
        props = torch.cuda.get_device_properties(0)
        lines.append(f"backend: GPU {props.name} ({runtime.device_name()}), "
                     f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    path, why = runtime.config_choice()
    lines.append(f"tune config: {path} ({why})")
    from gemslib.runtime import native

    lines.append(f"native replay of repeated calls: {native.status()}")
    lines.append("operators: " + ", ".join(
        f"{name} ({len(atens)} aten overrides)" for name, atens in gemslib.registered_ops().items()))
    return lines


def check_operators(rows: int, time_rows: int | None, out=print) -> int:
    """Run every self-check; return the number of failures."""
    import torch

    from gemslib import accuracy, registry, runtime

    device = torch.device(runtime.device_type())
    failures = 0
    header = f"{'check':<24}{'dtype':<10}{'max rel err':>12}{'tolerance':>11}  result"
    if time_rows:
        header += f"{'gemslib us':>12}{'torch us':>10}{'speedup':>9}"
    out(header)
    for operator in registry.operators().values():
        for check in operator.self_checks:
            for dtype in check.dtypes:
                inputs = check.make_inputs(device, dtype, rows)
                expected = check.reference(*[t.double() for t in inputs])
                try:
                    actual = check.run(*inputs)
                    error = accuracy.max_relative_error(actual, expected)
                    accuracy.assert_close_to_reference(actual, expected, dtype,
                                                       term_scale=check.term_scale(*inputs))
                    ok, result = True, "ok"
                except Exception as err:  # report and go on: one failure must not hide others
                    ok, error = False, float("nan")
                    result = f"FAIL: {str(err).splitlines()[0][:100]}"
                failures += not ok
                line = (f"{check.name:<24}{str(dtype).replace('torch.', ''):<10}{error:>12.2e}"
                        f"{accuracy.tolerance(dtype)['rtol']:>11.1e}  {result:<6}")
                if time_rows and ok:
                    import triton.testing

                    big = check.make_inputs(device, dtype, time_rows)
                    ours = triton.testing.do_bench(lambda: check.run(*big), return_mode="median")
                    theirs = triton.testing.do_bench(lambda: check.torch_peer(*big),
                                                     return_mode="median")
                    line += f"{ours * 1e3:>12.1f}{theirs * 1e3:>10.1f}{theirs / ours:>8.2f}x"
                out(line)
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gemslib", description=doc_summary(__doc__),
        usage="python -m gemslib [-h] [--rows N] [--time-rows N] [--no-time]\n"
              "       python -m gemslib demo [-h] [demo options]",
        epilog="commands:\n  demo  Llama-3-8B-shaped decoder layers run five ways, checked "
               "against each other,\n        and a transformers Llama through "
               "backend=\"gemslib\"\n        (python -m gemslib demo --help lists its options)\n\n"
               "exit codes: 0 every check passed, 1 a check failed, 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=61, metavar="N",
                        help="leading size of the check problems (default: 61)")
    parser.add_argument("--time-rows", type=positive_int, default=8192, metavar="N",
                        help="leading size of the timed problems (GPU only; default: 8192)")
    parser.add_argument("--no-time", action="store_true", help="skip the timings on a GPU")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        import torch

        from gemslib import demo, runtime

        demo.parse_args(argv[1:])  # bad arguments (and --help) end here, before any re-exec
        if not runtime.INTERPRETER and not torch.cuda.is_available():
            _reexec_under_interpreter(argv)
        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)

    import torch

    from gemslib import runtime

    if not runtime.INTERPRETER and not torch.cuda.is_available():
        _reexec_under_interpreter(argv)
    started = time.perf_counter()
    for line in describe_environment():
        print(line)
    print()
    time_rows = None if (runtime.INTERPRETER or args.no_time) else args.time_rows
    failures = check_operators(args.rows, time_rows)
    elapsed = time.perf_counter() - started
    if failures:
        print(f"\n{failures} check(s) FAILED ({elapsed:.1f} s)")
        return 1
    print(f"\nall checks passed ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
