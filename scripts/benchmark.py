r"""Every sequence-parallel strategy on the same model, weights and inputs (docs/benchmark.md).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no scripts/benchmark.py                  # video default, N = 2
    ... scripts/benchmark.py --model bytelm-small --seq-len 1024  # the text model
    ... scripts/benchmark.py --mode end-to-end|weak|strong

Writes results.json, results.md and results.png into --out (default outputs/bench).
"""

from dspzoo.core.bench import main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "benchmark.py"))
