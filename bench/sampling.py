"""Sampling alone: the Gumbel-argmax kernels (`pdserve/engine/sampling_kernel.py`) at decode batch
sizes: bfloat16 logits with each row's vocabulary split over programs (what the server runs)
against float32 logits with one program per row (the design it replaced), and the time to read
the bfloat16 logits once at the GPU's copy bandwidth. Timed inside CUDA graphs (GPU time: a
decode step's host work runs ahead of the GPU). Every row samples (temperature 0.6), the costlier
branch.

    python bench/sampling.py --vocab 151936 --batch-sizes 1,16,64,128,256 --out sampling.json
    python bench/sampling.py --programs-per-sm 2,4,8,16,32   # the split's width, PROGRAMS_PER_SM
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_bytes_per_s, graph_time_ms, write_results  # noqa: E402

from pdserve.engine.sampling import SamplingTensors  # noqa: E402
from pdserve.engine.sampling_kernel import (  # noqa: E402
    PROGRAMS_PER_SM,
    _sm_count,
    gumbel_argmax_cuda,
    split,
)
from pdserve.sampling_params import SampleRow, SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch-sizes", default="1,16,64,128,256")
    parser.add_argument("--programs-per-sm", default=str(PROGRAMS_PER_SM),
                        help="split settings to time besides each other, comma-separated "
                        f"(the server's: {PROGRAMS_PER_SM})")
    parser.add_argument("--out", default="sampling.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/sampling.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_bytes_per_s()
    programs = PROGRAMS_PER_SM * _sm_count(device)
    results = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        logits = (torch.randn(batch, args.vocab, device=device) * 3).bfloat16()
        wide = logits.float()
        rows = [SampleRow(SamplingParams(temperature=0.6, seed=i), output_index=i)
                for i in range(batch)]
        st = SamplingTensors.from_rows(rows, device)
        call = (logits, st.temperature, st.seed_lo, st.seed_hi, st.output_index)
        split_ms = {}
        settings = {PROGRAMS_PER_SM, *(int(p) for p in args.programs_per_sm.split(","))}
        for per_sm in sorted(settings):
            split_ms[per_sm] = graph_time_ms(
                lambda n=per_sm * _sm_count(device): gumbel_argmax_cuda(*call, programs=n))
        before = (wide, *call[1:])
        per_row_ms = graph_time_ms(lambda: gumbel_argmax_cuda(*before, programs=batch))
        assert torch.equal(gumbel_argmax_cuda(*call), gumbel_argmax_cuda(*before, programs=batch))
        floor_ms = logits.numel() * logits.element_size() / (bandwidth / 2) * 1e3
        results.append({"batch": batch, "parts": split(batch, args.vocab, programs)[0],
                        "split_bf16_ms": round(split_ms[PROGRAMS_PER_SM], 4),
                        "split_bf16_ms_by_programs_per_sm": {
                            p: round(ms, 4) for p, ms in split_ms.items()},
                        "one_program_per_row_fp32_ms": round(per_row_ms, 4),
                        "read_once_floor_ms": round(floor_ms, 4)})
        print(results[-1])
    write_results(args.out, "sampling", {"vocab": args.vocab, "programs": programs,
                                         "copy_bandwidth_gb_s": round(bandwidth / 1e9),
                                         "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
