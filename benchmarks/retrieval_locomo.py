"""The base retriever on LoCoMo, per memory granularity, as a user gets it from the CLI.

    python benchmarks/retrieval_locomo.py --out-dir benchmarks/results

For each granularity (``--granularities``): ``rmm-jax embed locomo:DATA --out S
--granularity G`` into a scratch store, then ``rmm-jax retrieve S --k 20 --pad-short-banks
--json`` (conversations 26 and 30 have only 19 sessions each, so K = 20 at session level needs the
padding). Each command's JSON goes, with the commands and the provenance, to
``OUT_DIR/retrieval_locomo_G.json``: what docs/own-data.md's table of the retriever reads.
Embeddings come from the embedding cache after the first build.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _common import HelpFormatter, add_data_option, choice_list, positive_int, require_data, run_cli, write_result

GRANULARITIES = ("turn", "segment", "session")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_data_option(ap)
    ap.add_argument("--granularities", type=choice_list(*GRANULARITIES), default=",".join(GRANULARITIES),
                    help="comma-separated")
    ap.add_argument("--k", type=positive_int, default=20, help="candidates retrieved per question")
    ap.add_argument("--out-dir", type=Path, required=True, help="writes retrieval_locomo_G.json here")
    args = ap.parse_args(argv)
    data = require_data(args.data)
    for g in args.granularities:
        with tempfile.TemporaryDirectory() as tmp:
            store = str(Path(tmp) / "store")
            embed = ["embed", f"locomo:{data}", "--out", store, "--granularity", g]
            retrieve = ["retrieve", store, "--k", str(args.k), "--pad-short-banks", "--json"]
            print(f"{g}: rmm-jax embed (from the embedding cache after the first build)", file=sys.stderr, flush=True)
            run_cli(embed)
            print(f"{g}: rmm-jax retrieve --k {args.k}", file=sys.stderr, flush=True)
            got = json.loads(run_cli(retrieve))
        got["command"] = (f"rmm-jax embed locomo:{args.data} --out S --granularity {g} && "
                          f"rmm-jax retrieve S --k {args.k} --pad-short-banks --json")
        write_result(args.out_dir / f"retrieval_locomo_{g}.json", got)
        print(f"{g}: {got['counts']['memories']} memories, R@5 {got['overall']['recall@5']:.3f}")


if __name__ == "__main__":
    main()
