"""The short table that research/issue34_ab*.sh print last, from what they left in a folder:
cold_*.txt (research/cold_timeline.py: its first line), probe_*.json (research/host_path_probe.py)
and overhead_*.json (bench.overhead), one row each, named by the file's tree and round.
    python research/ab_table.py $OUT"""
from __future__ import annotations

import glob
import json
import os
import sys

PROBE_KEYS = ["epifuse_gemm", "signature", "lookup", "site_call_without_launch", "launch_with", "torch_addmm_out"]


def main(folder: str) -> None:
    for f in sorted(glob.glob(folder + "/cold_*.txt")):
        print(f"{os.path.basename(f)[:-4]:28s} {open(f).readline().strip()[-60:]}")
    print("probe (tune 0)     " + " ".join(f"{k[:12]:>12s}" for k in PROBE_KEYS))
    for f in sorted(glob.glob(folder + "/probe_*.json")):
        try:
            d = json.load(open(f))
            print(f"{os.path.basename(f)[6:-5]:18s} " + " ".join(f"{d[k]:12.2f}" for k in PROBE_KEYS))
        except (OSError, ValueError, KeyError) as e:
            print(f, "unreadable", e)
    for f in sorted(glob.glob(folder + "/overhead_*.json")):
        try:
            d = json.load(open(f))
            print(f"{os.path.basename(f)[9:-5]:10s} gemm {d['epifuse_gemm_us']:6.2f} addmm {d['torch_addmm_us']:6.2f} "
                  f"over {d['gemm_over_addmm_us']:5.2f} | new out {d['epifuse_gemm_new_output_us']:6.2f} vs "
                  f"{d['torch_addmm_relu_us']:6.2f} over {d['new_output_over_addmm_relu_us']:5.2f} | {d['kernel']}")
        except (OSError, ValueError, KeyError) as e:
            print(f, "unreadable", e)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"])
