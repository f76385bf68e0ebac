"""The planner's TPU tables: compiled for TPU topologies on this CPU with libtpu (``flax_ln.plan``), not TPU runs.

    python benchmarks/tpu_plan.py fsdp  --out tpu_fsdp.jsonl    # GPT-2 124M on v5e:2x4, B=16, T=1024, fsdp 1..8,
                                                                 # the batch over data only (before) and data x fsdp
    python benchmarks/tpu_plan.py table --out tpu_table.jsonl   # the planner's table in docs/tpu.md (--search batch,
                                                                 # at most 3 compiles per row)
    python benchmarks/tpu_plan.py show tpu_fsdp.jsonl tpu_table.jsonl   # both as markdown

Each plan is one ``flax_ln.plan.run`` (the same as ``flax-ln plan``); every result is appended
to the JSONL file as soon as it is made, so a long run can be read while it goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from flax_ln import plan

GIB = 2**30

TABLE = [  # (model, topology, --seq-len); bfloat16, remat, fsdp = the chip count
    ("gpt2", "v5e:2x4", None),
    ("music", "v5e:2x4", 2048),
    ("gpt2-xl", "v5e:2x4", None),
    ("gpt2", "v4:2x2x1", None),
    ("gpt2", "v5p:2x2x1", None),
    ("music", "v4:2x2x1", 2048),
    ("music", "v5p:2x2x1", 2048),
    ("gpt2-xl", "v4:2x2x1", None),
    ("gpt2-xl", "v5p:2x2x1", None),
    ("gpt2-xl", "v5e:4x4", None),
]


def append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


FSDP_ROWS = [  # (batch axes, fsdp); at fsdp 1 both rules are the same sharding, so it is compiled once
    (["data", "fsdp"], 1),
    (["data", "fsdp"], 8),
    (["data"], 8),
    (["data", "fsdp"], 2),
    (["data", "fsdp"], 4),
    (["data"], 2),
    (["data"], 4),
]


def fsdp_rows(out: str, rows: list[int]) -> None:
    for axes, fsdp in [FSDP_ROWS[i] for i in rows]:
        request = plan.make_request("gpt2", "v5e:2x4", batch=16, seq_len=1024, fsdp=fsdp, remat=True)
        request["batch_axes"] = axes
        start = time.perf_counter()
        result = plan.run(request)
        append(out, {"batch_axes": axes, "wall_seconds": round(time.perf_counter() - start, 1), **result})
        print(axes, fsdp, result["per_chip"], result.get("error"), flush=True)


def table_rows(out: str, rows: list[int]) -> None:
    for model, topology, seq_len in [TABLE[i] for i in rows]:
        request = plan.make_request(model, topology, seq_len=seq_len, remat=True, search="batch")
        request["max_compiles"] = 3  # time: 3 compiles per row; smallest_failing shows how tight the answer is
        start = time.perf_counter()
        result = plan.run(request)
        append(out, {"wall_seconds": round(time.perf_counter() - start, 1), **result})
        print(model, topology, result.get("search"), result.get("error"), flush=True)


def show(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        if records and "batch_axes" in records[0]:
            print(
                "| batch split over | fsdp | arguments per chip | temporaries per chip | total per chip | compile s |"
            )
            print("|---|---|---|---|---|---|")
            for r in records:
                pc = r["per_chip"]
                print(
                    f"| {' x '.join(r['batch_axes'])} | {r['fsdp']} | {pc['argument_bytes'] / GIB:.2f} GiB | "
                    f"{pc['temp_bytes'] / GIB:.2f} GiB | {pc['total_bytes'] / GIB:.2f} GiB | {r['compile_seconds']} |"
                )
        else:
            print(
                "| model | topology | chips | fsdp | largest batch | per-chip memory (of HBM) | roofline tokens/s | "
                "mfu_ceiling | bound | compiles, wall s |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            for r in records:
                pc, rf, s = r["per_chip"], r.get("roofline") or {}, r.get("search") or {}
                mem = "n/a" if pc["total_bytes"] is None else f"{pc['total_bytes'] / GIB:.2f}"
                tps = f"{rf['tokens_per_second']:,.0f}" if rf else "n/a"
                mfu = f"{rf['mfu_ceiling']:.2f}" if rf else "n/a"
                print(
                    f"| {r['model']} T={r['seq_len']} | {r['topology']} | {r['chips']} | {r['fsdp']} | "
                    f"{s.get('best')} | {mem} of {pc['capacity_bytes'] / GIB:.0f} GiB | {tps} | {mfu} | "
                    f"{rf.get('bound', 'n/a')} | {len(s.get('tried', []))}, {r['wall_seconds']} |"
                )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["fsdp", "table", "show"])
    p.add_argument("files", nargs="*", help="show: the JSONL files")
    p.add_argument("--out", help="fsdp/table: the JSONL file to append to")
    p.add_argument("--rows", help="fsdp/table: only these rows, e.g. 0,2,5 (default all)")
    args = p.parse_args()
    if args.what == "show":
        show(args.files)
    elif not args.out:
        p.error("--out is required for fsdp and table")
    else:
        n = len(FSDP_ROWS if args.what == "fsdp" else TABLE)
        rows = [int(i) for i in args.rows.split(",")] if args.rows else list(range(n))
        (fsdp_rows if args.what == "fsdp" else table_rows)(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
