"""What the GPU's clock does under the vision encoder's load, and what that means for its FLOP floor (GPU only).

    python benchmarks/experiments/power_probe.py OUT_DIR [golden]
    python benchmarks/experiments/power_probe.py --summary PROBE_JSON CLOCKS_CSV    (any machine: the clock per phase)

Logs nvidia-smi's SM clock, power and temperature every 20 ms into OUT_DIR/clocks.csv while it measures, with
a time mark per phase in OUT_DIR/probe.json:
- gpu_bench's ceilings, twice: the bf16 matmul from idle (13 calls of 8192^3) and sustained (a CUDA graph of 12
  back to back, 10 times: about as long as gpu_bench's 10 back-to-back encodes of 13 crops);
- three interleaved rounds of gpu_bench's vision rows, the engine's CUDA graphs against eager, 13 and 52 crops
  (the graph rows with ten encodes that each follow 0.2 s idle, as a lone image query meets the GPU);
- the LM head of one row with and without its greedy epilogue (bans + atomic max), for the decode step.
With "golden" it first runs gpu_bench's engine check (float32 engine against the reference's outputs).
"""

import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def summary(probe_json: str, clocks_csv: str) -> None:
    """Per phase: nvidia-smi's samples between its mark and the next, SM clock (min / median / max, MHz)
    and power (median / max, W). nvidia-smi's timestamps are the machine's local time, as time.time()."""
    marks = json.loads(Path(probe_json).read_text())["marks"]
    samples = []
    for line in Path(clocks_csv).read_text().splitlines():
        stamp, clock, power, _ = (f.strip() for f in line.split(","))
        t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
        samples.append((t.timestamp(), int(clock.split()[0]), float(power.split()[0])))
    print("| phase | samples | SM clock min / median / max (MHz) | power median / max (W) |\n| --- | --- | --- | --- |")
    for (name, start), (_, end) in zip(marks, marks[1:]):
        inside = [(c, p) for t, c, p in samples if start <= t < end]
        if inside:
            clocks, watts = sorted(c for c, _ in inside), sorted(p for _, p in inside)
            print(f"| {name} | {len(inside)} | {clocks[0]} / {statistics.median(clocks):.0f} / {clocks[-1]} "
                  f"| {statistics.median(watts):.0f} / {watts[-1]:.0f} |")


def main() -> None:
    import torch

    import benchmarks.common as gb
    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.weights import random_weights
    from kestrel_backend.kernels import decode_kernels as dk

    out = Path(sys.argv[1])
    res = {"marks": []}

    def mark(name):
        res["marks"].append((name, time.time()))
        print("MARK", name, flush=True)

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader", "-lms", "20"], stdout=open(out / "clocks.csv", "w"))
    try:
        if "golden" in sys.argv:
            mark("golden")
            res["engine_golden"] = gb.engine_golden_check()
        mark("ceilings")  # (each with the sustained rate: a CUDA graph of 12 back to back, 10 times)
        res["ceilings"] = [gb.ceilings() for _ in range(2)]
        print("ceilings", res["ceilings"], flush=True)

        config = MoondreamConfig()
        model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
        res["vision"] = []
        for r in range(3):  # (the engine's graph rows include ten encodes from idle)
            for variant in ("graph", "eager"):
                for n in (13, 52):
                    mark(f"vision {variant} {n} r{r}")
                    row = gb.vision_bench(model, res["ceilings"][0], variant, n)
                    row["round"] = r
                    res["vision"].append(row)
                    print(json.dumps(row), flush=True)

        mark("lm head")
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, 2048, **bf)
        ln_w, ln_b = torch.randn(2048, **bf), torch.randn(2048, **bf)
        head, head_b = torch.randn(51200, 2048, **bf) / 45, torch.randn(51200, **bf)
        logits = torch.empty(1, 51200, device="cuda", dtype=torch.float32)
        banned = torch.full((1, 4), -1, device="cuda", dtype=torch.int32)
        best = dk.greedy_keys(1, "cuda")
        lm = {}
        for _ in range(3):
            for tiles in (None, (1, 4, 2048, 4, 2, False), (1, 16, 1024, 4, 2, False), (1, 8, 2048, 8, 2, False)):
                for greedy in (False, True):
                    kw = dict(banned=banned, best=best) if greedy else {}
                    call = lambda: (best.zero_() if greedy else None,  # noqa: E731
                                    dk.norm_linear(x, ln_w, ln_b, head, head_b, out1=logits, tiles=tiles, **kw))
                    lm.setdefault(f"{tiles} greedy={greedy}", []).append(gb.graph_timed(call, calls=8) * 1000)
        res["lm_head_us"] = lm
        for k, v in lm.items():
            print("lm head", k, [round(u, 1) for u in v], flush=True)
    finally:
        mark("end")
        smi.terminate()
        (out / "probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        summary(sys.argv[2], sys.argv[3])
    else:
        main()
