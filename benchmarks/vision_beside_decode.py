"""Can the vision encoder (compute bound) run beside Moondream 3's decode steps (memory bound) on one GPU, so that
a burst's images cost less than their encode alone? (GPU only; full-size random weights, FP8 experts.)

STEPS decode steps of BATCH rows at context 800 (pairs of rows sharing an image prefix, as in a burst) on a
high-priority stream, and REPLAYS vision-encoder graph replays of 10 crops on a second stream: each alone, then
both launched together. The encoder's graphs are captured with cuBLAS's SM carveout (torch's experimental
setting: its GEMMs leave that many SMs free) or replayed on a green context's stream of fewer SMs.

    python benchmarks/vision_beside_decode.py BATCH STEPS REPLAYS [out.json]   # e.g. 24 40 14
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_bench import engine_step, random_kv_cache  # noqa: E402
from benchmarks.moondream3_bench import experts_to_fp8  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder  # noqa: E402
from kestrel_backend.runtime.vision_graphs import CropEncoderGraphs  # noqa: E402

CROPS = 10


def wall(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


def main():
    bsz, context, n_steps, n_vis = int(sys.argv[1]), 800, int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    config = MoondreamConfig.official("moondream3")
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    experts_to_fp8(model)
    cache = random_kv_cache(config.text, bsz, context, sharing=2)
    hp = torch.cuda.Stream(priority=-5)
    lp = torch.cuda.Stream(priority=0)
    crops = torch.randn(CROPS, 3, config.vision.crop_size, config.vision.crop_size, device="cuda",
                        dtype=torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "batch": bsz, "steps": n_steps, "vision_replays": n_vis, "crops": CROPS}
    with torch.inference_mode():
        decoder = CudaGraphDecoder(model, cache, bsz, context + 9)
        step = engine_step(decoder, bsz, context)
        with torch.cuda.stream(hp):
            for _ in range(5):
                step()

        def decode():
            with torch.cuda.stream(hp):
                for _ in range(n_steps):
                    step()

        encoders = {}
        for carve in (None, 16, 32, 48, 66):
            torch._C._set_sm_carveout_experimental(carve)
            enc = CropEncoderGraphs(model)
            enc(crops)  # capture
            encoders[f"carveout {carve}"] = (enc, None)
        torch._C._set_sm_carveout_experimental(None)
        try:
            from torch.cuda.green_contexts import GreenContext
            for sms in (100, 66):
                gc = GreenContext.create(num_sms=sms)
                enc = CropEncoderGraphs(model)
                enc(crops)
                encoders[f"green {sms} SMs"] = (enc, gc)
        except Exception as e:  # noqa: BLE001
            res["green_error"] = repr(e)

        res["decode_alone_ms"] = min(wall(decode) for _ in range(3))
        for name, (enc, gc) in encoders.items():
            stream = gc.Stream() if gc is not None else lp

            def vision():
                with torch.cuda.stream(stream):
                    for _ in range(n_vis):
                        enc(crops)

            alone = min(wall(vision) for _ in range(3))
            both, dec_part = [], []
            for _ in range(3):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t = time.perf_counter()
                vision()
                a.record(hp)
                decode()
                b.record(hp)
                torch.cuda.synchronize()
                both.append((time.perf_counter() - t) * 1000)
                dec_part.append(a.elapsed_time(b))
            res[name] = {"vision_alone_ms": alone, "together_ms": min(both), "decode_in_together_ms": min(dec_part),
                         "sum_alone_ms": alone + res["decode_alone_ms"]}
            print(name, json.dumps(res[name]), flush=True)
    print(json.dumps(res))
    if len(sys.argv) > 4:
        with open(sys.argv[4], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
