"""Write the tuned kernel config tables that `quant_bench.py kernels` / `moe_bench.py tune`
measured into the kernel modules: FP8_GEMV_CONFIGS (ferrum/ops/fp8.py), W4_GEMV_CONFIGS
(ferrum/ops/int4.py), GGUF_GEMV_CONFIGS (ferrum/ops/gguf.py), MOE_GEMM_CONFIGS
(ferrum/ops/moe_triton.py), GLUON_GEMV_CONFIGS (ferrum/ops/gemv_gluon.py), each replacing the
module's current literal.

    python3 benchmarks/paste_gemv_configs.py OUT/quant_kernels.json [OUT/moe_tune.json] [--root .]

The JSON holds each table as {"(N, K, rows)": [config...]} (keys are the tuples' reprs). A
table the JSON lacks is left as it is; `--merge` keeps the entries of a table that the JSON
does not have (a sweep of some kernels only). Prints what it replaced.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re

TABLES = {"FP8_GEMV_CONFIGS": "ferrum/ops/fp8.py", "W4_GEMV_CONFIGS": "ferrum/ops/int4.py",
          "GGUF_GEMV_CONFIGS": "ferrum/ops/gguf.py", "MOE_GEMM_CONFIGS": "ferrum/ops/moe_triton.py",
          "GLUON_GEMV_CONFIGS": "ferrum/ops/gemv_gluon.py"}


def literal(table: dict[str, list]) -> str:
    """{"(a, b, c)": [x, y]} -> a Python dict literal with tuple keys and values (None kept), one
    entry a line."""
    items = sorted((ast.literal_eval(k), None if v is None else tuple(v)) for k, v in table.items())
    if not items:
        return "{}"
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in items) + "}"


def _literal_span(source: str, name: str) -> tuple[int, int]:
    """(start, end) of the dict literal assigned to `name` at module level in source. Raises
    ValueError when the assignment is not found."""
    m = re.search(rf"^{name}\s*:[^=\n]*=\s*", source, flags=re.M)
    if m is None:
        raise ValueError(f"{name} assignment not found")
    depth = 0
    for i in range(m.end(), len(source)):   # the literal ends where its braces balance
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return m.end(), i + 1
    return m.end(), m.end()


def current_table(source: str, name: str) -> dict[str, list | None]:
    """The dict literal assigned to `name` in source, keyed as the JSON is (tuple reprs)."""
    start, end = _literal_span(source, name)
    return {repr(k): None if v is None else list(v) for k, v in ast.literal_eval(source[start:end]).items()}


def replace_table(source: str, name: str, new_literal: str) -> str:
    """source with the dict literal assigned to `name` at module level replaced. Raises
    ValueError when the assignment is not found."""
    start, end = _literal_span(source, name)
    return source[:start] + new_literal + source[end:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES),
                   help="write only these tables (default: every one the JSON holds)")
    p.add_argument("--merge", action="store_true", help="keep the entries the JSON does not have")
    args = p.parse_args()
    res = {}
    for path in args.json:
        with open(path) as f:
            res.update({k: v for k, v in json.load(f).items() if k in args.tables})
    for name, rel in TABLES.items():
        if name not in args.tables:
            continue
        if not res.get(name):
            print(f"{name}: not in {' '.join(args.json)}, left as it is")
            continue
        path = os.path.join(args.root, rel)
        with open(path) as f:
            source = f.read()
        table = {**current_table(source, name), **res[name]} if args.merge else res[name]
        with open(path, "w") as f:
            f.write(replace_table(source, name, literal(table)))
        print(f"{name}: {len(res[name])} entries written to {rel}")


if __name__ == "__main__":
    main()
