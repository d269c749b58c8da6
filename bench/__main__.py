"""The benchmarks, outside the installed package: `python -m bench [--only scale|knn|study|floor] ...`
from the repository root (records under <data-root>/bench/; the kept ones in bench/records/)."""

from __future__ import annotations

import argparse
import sys

from bench.driver import cmd_bench
from updatelens.registry import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--data-root")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model whose forward passes --only floor counts")
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda[:i]: where the model, fits and (with faiss-gpu) exact search run; "
                                "recorded with every figure")
    parser.add_argument("--ann-tokens", dest="ann_tokens", type=int, default=131072,
                        help="sample size of the approximate-index bench (--only knn)")
    parser.add_argument("--ann-layers", dest="ann_layers", default="8,15",
                        help="TUNE,JUDGE: the layer the search settings are tuned on and the one that "
                                "judges them (--only knn)")
    parser.add_argument("--scaling-n", default="2048,8192,16384",
                        help="token counts of the scaling sweep (32768 adds about a minute)")
    parser.add_argument("--scaling-d-at", type=int, default=2048, help="N at which d is varied (288, 576, 1152)")
    parser.add_argument("--only", choices=["scale", "knn", "study", "floor"],
                        help="scale: the pipeline's peak memory and time against the sample size; knn: "
                                "approximate k-NN against exact search and faiss's indexes at research scale; "
                                "study: the study preset (hours on a CPU), its time, memory and step times; floor: the "
                                "least time the forward passes of the study and of the default job take on this device "
                                "(a minute)")
    parser.add_argument("--scale-tokens", dest="scale_tokens", default="2048,8192,32768,131072",
                        help="sample sizes of the scale bench (one layer, the study preset's settings)")
    parser.add_argument("--scale-layer", dest="scale_layer", type=int, default=15,
                        help="the layer the scale bench runs (default 15, the middle of SmolLM2)")
    return int(cmd_bench(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
