"""The fused mixture-of-experts forward on the GPU: two grouped GEMMs over tokens sorted by
expert (``moe_align.py``), one Triton program per block of sorted rows and columns, each
multiplying its rows by one expert's weights, then the weighted sum over each token's experts.

Every expert's weights are read once per step however many tokens chose it, and no expert
computes a token that did not choose it; there is no host sync, so decode's CUDA graphs
capture it. Checked against ``grouped_gemm_reference`` (Triton's interpreter runs it on the CPU)
and, on the device, against the reference loop (tests/test_gpu_moe.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.models import gemv_kernel, pdl
from pdserve.models.moe_align import SortedAssignments, sorted_rows


@triton.jit
def _grouped_gemm(a, w, c, scale, w_scale, sorted_ids, block_expert, assignments, N, K,
                  rows_per_a, stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn,
                  scale_cols, row_blocks, HAS_SCALE: tl.constexpr, W_SCALES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, SILU_AND_MUL: tl.constexpr = False):
    # Program order: GROUP_M 0 walks every row block for one column block, then the next
    # column block; GROUP_M g > 0 every column block of g row blocks, then the next g (rows
    # and an expert's weights each read while they are still in L2).
    pid = tl.program_id(0)
    if GROUP_M == 0:
        block = pid % row_blocks
        col_block = pid // row_blocks
    else:
        col_blocks = tl.cdiv(N, BLOCK_N)
        first = pid // (GROUP_M * col_blocks) * GROUP_M
        rows_here = tl.minimum(row_blocks - first, GROUP_M)
        block = first + (pid % (GROUP_M * col_blocks)) % rows_here
        col_block = (pid % (GROUP_M * col_blocks)) // rows_here
    expert = tl.load(block_expert + block)
    if expert < 0:
        return
    ids = tl.load(sorted_ids + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < assignments
    a_rows = a + (ids // rows_per_a)[:, None].to(tl.int64) * stride_am
    if SILU_AND_MUL:   # N gate rows then N up rows; each program BLOCK_N of each
        _gate_up_silu(a_rows, valid, w, c, expert, ids, col_block, N, K, stride_we, stride_wn,
                      stride_cm, BLOCK_M, BLOCK_N, BLOCK_K)
        return
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = w + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # FP8 weights' scales (a row's, per scale_cols columns): W_SCALES 1 one per row, applied
    # once at the end; 2 one per row and step (scale_cols a multiple of BLOCK_K); 3 any other
    # blocking, element by element. e4m3 values are exact in 16 bits.
    row_scales = w_scale + expert.to(tl.int64) * stride_se + cols * stride_sn
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        w_mask = (ks[:, None] < K) & (cols[None, :] < N)
        y = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)
        if W_SCALES == 2:
            s = tl.load(row_scales + step * BLOCK_K // scale_cols, mask=cols < N, other=0.0)
            acc += tl.dot(x, y.to(x.dtype)) * s[None, :]
        elif W_SCALES == 3:
            s = tl.load(row_scales[None, :] + ks[:, None] // scale_cols, mask=w_mask, other=0.0)
            acc = tl.dot(x, (y.to(tl.float32) * s).to(x.dtype), acc)
        else:
            acc = tl.dot(x, y.to(x.dtype), acc)
    if W_SCALES == 1:
        acc = acc * tl.load(row_scales, mask=cols < N, other=0.0)[None, :]
    if HAS_SCALE:
        acc = acc * tl.load(scale + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c + ids[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _gate_up_silu(a_rows, valid, w, c, expert, ids, col_block, N, K, stride_we, stride_wn,
                  stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """BLOCK_N columns of SiLU(gate) * up for a block of rows (16-bit weights): each product
    rounded as the grouped GEMM's output, then SiLU-and-mul in float32."""
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_cols = w + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    up_cols = gate_cols + N.to(tl.int64) * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        w_mask = (ks[:, None] < K) & (cols[None, :] < N)
        gate = tl.dot(x, tl.load(gate_cols + ks[:, None], mask=w_mask, other=0.0), gate)
        up = tl.dot(x, tl.load(up_cols + ks[:, None], mask=w_mask, other=0.0), up)
    gate = gate.to(c.dtype.element_ty).to(tl.float32)
    up = up.to(c.dtype.element_ty).to(tl.float32)
    out = c + ids[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, (gate / (1.0 + tl.exp(-gate)) * up).to(c.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _sum_slots(h, out, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """One token's rows of ``h`` (its top-k experts' outputs, already weighted) summed in
    float32 in slot order, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOP_K):
        total += tl.load(h + (token * TOP_K + slot) * hidden + cols, mask=cols < hidden,
                         other=0.0).to(tl.float32)
    tl.store(out + token * hidden + cols, total.to(out.dtype.element_ty), mask=cols < hidden)


def sum_slots(h: torch.Tensor, top_k: int) -> torch.Tensor:
    """``h.view(tokens, top_k, -1).sum(1, dtype=float32).to(h.dtype)`` in one launch."""
    rows, hidden = h.shape
    out = torch.empty(rows // top_k, hidden, dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots[(rows // top_k, triton.cdiv(hidden, block))](h.contiguous(), out, hidden,
                                                            TOP_K=top_k, BLOCK=block)
    return out


@triton.jit
def _padded_offsets(counts, BLOCK_M: tl.constexpr):
    """Each expert's first and past-the-end rows, its assignments padded to whole blocks."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    return padded_end - padded, padded_end


@triton.jit
def _blocks_and_padding(padded_end, block_expert, sorted_ids, count, rows,
                        EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, LANES: tl.constexpr):
    """Each block's expert (-1 past the last expert's blocks), and every row set to ``count``
    (the padding: rows no assignment fills keep it)."""
    lane = tl.arange(0, LANES)
    for first in range(0, rows // BLOCK_M, LANES):
        blocks = first + lane
        owner = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32),
                       axis=1)
        tl.store(block_expert + blocks, tl.where(owner < EXPERTS, owner, -1),
                 mask=blocks * BLOCK_M < rows)
    for start in range(0, rows, LANES):
        tl.store(sorted_ids + start + lane, count, mask=start + lane < rows)


@triton.jit
def _rows_in_chunk(ids, lane, first, experts):
    """Each of a chunk's assignments' row: ``first`` (per expert) for its expert plus its rank
    among the chunk's earlier assignments to it; and which expert each chose (one-hot)."""
    mine = ids[:, None] == experts[None, :]
    earlier = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    row = (tl.sum(tl.where(mine, first[None, :], 0), axis=1)
           + tl.sum(earlier.to(tl.int32), axis=1))
    return row, mine


@triton.jit
def _sort_small(chosen, sorted_ids, block_expert, count, rows,
                EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr,
                CHUNK: tl.constexpr):
    """sort_by_expert in one program: counts, padded offsets, block experts, then each
    assignment's row (its expert's offset plus its rank among that expert's assignments)."""
    experts = tl.arange(0, EXPERTS_P)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_P], tl.int32)
    for start in range(0, count, CHUNK):
        ids = tl.load(chosen + start + lane, mask=start + lane < count, other=EXPERTS_P)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded_start, padded_end = _padded_offsets(counts, BLOCK_M)
    _blocks_and_padding(padded_end, block_expert, sorted_ids, count, rows, EXPERTS, BLOCK_M,
                        CHUNK)
    tl.debug_barrier()   # the padding is written before any assignment's row
    placed = tl.zeros([EXPERTS_P], tl.int32)
    for start in range(0, count, CHUNK):
        valid = start + lane < count
        ids = tl.load(chosen + start + lane, mask=valid, other=EXPERTS_P)
        row, mine = _rows_in_chunk(ids, lane, padded_start + placed, experts)
        tl.store(sorted_ids + row, (start + lane).to(tl.int32), mask=valid)
        placed += tl.sum(mine.to(tl.int32), axis=0)


@triton.jit
def _count_chunk(chosen, counts, totals, sorted_ids, count, rows, fill_rows,
                 EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr):
    """One chunk of assignments: how many chose each expert (its row of ``counts``, and added
    to ``totals``); and its share of the rows set to ``count`` (the padding: rows no
    assignment fills keep it)."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    experts = tl.arange(0, EXPERTS_P)
    ids = tl.load(chosen + chunk * CHUNK + lane, mask=chunk * CHUNK + lane < count,
                  other=EXPERTS_P)
    mine = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts + chunk * EXPERTS_P + experts, mine)
    tl.atomic_add(totals + experts, mine, mask=mine > 0)
    for start in range(chunk * fill_rows, tl.minimum(chunk * fill_rows + fill_rows, rows), CHUNK):
        tl.store(sorted_ids + start + lane, count, mask=start + lane < rows)


@triton.jit
def _chunk_offsets(counts, totals, offsets, block_expert, rows, chunks,
                   EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr,
                   LANES: tl.constexpr):
    """One program an expert, and one for id EXPERTS (assignments no expert here takes): each
    chunk's first row for it (its padded start plus the earlier chunks' assignments to it) and
    its blocks' expert; the last program's blocks, and those past them, are -1."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P)
    lane = tl.arange(0, LANES)
    padded_start, padded_end = _padded_offsets(tl.load(totals + experts), BLOCK_M)
    first = tl.sum(tl.where(experts == expert, padded_start, 0), axis=0)
    last = tl.sum(tl.where(experts == expert, padded_end, 0), axis=0)
    running = first
    for start in range(0, chunks, LANES):
        valid = start + lane < chunks
        mine = tl.load(counts + (start + lane) * EXPERTS_P + expert, mask=valid, other=0)
        tl.store(offsets + (start + lane) * EXPERTS_P + expert,
                 running + tl.cumsum(mine, axis=0) - mine, mask=valid)
        running += tl.sum(mine, axis=0)
    owner = tl.where(expert < EXPERTS, expert, -1)
    end = tl.where(expert < EXPERTS, last, rows)
    for block in range(first // BLOCK_M, end // BLOCK_M, LANES):
        tl.store(block_expert + block + lane, owner, mask=block + lane < end // BLOCK_M)


@triton.jit
def _place_chunk(chosen, offsets, sorted_ids, count, EXPERTS_P: tl.constexpr,
                 CHUNK: tl.constexpr):
    """One chunk's assignments into their rows: the chunk's first row for the expert plus the
    assignment's rank among the chunk's earlier ones to it."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    experts = tl.arange(0, EXPERTS_P)
    valid = chunk * CHUNK + lane < count
    ids = tl.load(chosen + chunk * CHUNK + lane, mask=valid, other=EXPERTS_P)
    row, _ = _rows_in_chunk(ids, lane, tl.load(offsets + chunk * EXPERTS_P + experts), experts)
    tl.store(sorted_ids + row, (chunk * CHUNK + lane).to(tl.int32), mask=valid)


@triton.jit
def _route(logits, weights, chosen, stride, first, held, EXPERTS: tl.constexpr,
           EXPERTS_P: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr,
           RENORMALIZE: tl.constexpr, HELD: tl.constexpr, PDL: tl.constexpr):
    """One token: softmax over its router logits (float32), its top-k (the lowest index among
    equals first), renormalised if asked. HELD: the experts as this rank's ids (``held`` of
    them from ``first``), another rank's as ``held``."""
    pdl.start(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P)
    x = tl.load(logits + token * stride + experts, mask=experts < EXPERTS,
                other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, TOP_K_P)
    values = tl.zeros([TOP_K_P], tl.float32)
    picks = tl.zeros([TOP_K_P], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, experts, EXPERTS_P), axis=0)
        values = tl.where(slots == slot, best, values)
        picks = tl.where(slots == slot, pick, picks)
        p = tl.where(experts == pick, -1.0, p)
    if RENORMALIZE:
        values = values / tl.sum(values, axis=0)
    if HELD:
        local = picks - first
        picks = tl.where((local >= 0) & (local < held), local, held)
    tl.store(weights + token * TOP_K + slots, values.to(weights.dtype.element_ty),
             mask=slots < TOP_K)
    tl.store(chosen + token * TOP_K + slots, picks, mask=slots < TOP_K)
    pdl.end(PDL)


def route_top_k(logits: torch.Tensor, top_k: int, renormalize: bool,
                dtype: torch.dtype = torch.float32, held: tuple[int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k softmax probabilities (computed in float32, stored as ``dtype``) and
    experts (int32), [tokens, top_k]: moe.SparseMoeBlock.route's softmax, topk, division and
    rounding in one launch. ``held`` (first, count): a rank's experts under --expert-parallel,
    the ids as its own and another rank's as ``count`` (ExpertParallelExperts.local_ids)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    chosen = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        dependent = pdl.mode(logits.device, "route")
        first, count = held or (0, 0)
        _route[(tokens,)](logits, weights, chosen, logits.stride(0), first, count,
                          EXPERTS=experts, EXPERTS_P=triton.next_power_of_2(experts),
                          TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k),
                          RENORMALIZE=renormalize, HELD=held is not None, PDL=dependent,
                          launch_pdl=dependent > 0,
                          num_warps=1)   # its reductions in one warp's shuffles: 2.1 us, not 3.2
    return weights, chosen


# Assignments up to this many are sorted by one Triton program (decode batches: one launch
# where the PyTorch statement takes about 25); more by sort_chunked's three.
SMALL_SORT_MAX = 1024


def sort_small(chosen: torch.Tensor, num_experts: int, block_m: int) -> SortedAssignments:
    """sort_by_expert's result (the same rows and blocks) by one Triton program; for at most
    SMALL_SORT_MAX assignments."""
    flat = chosen.reshape(-1).contiguous()
    count = flat.numel()
    rows = sorted_rows(count, num_experts, block_m)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=flat.device)
    _sort_small[(1,)](flat, sorted_ids, block_expert, count, rows, EXPERTS=num_experts,
                      EXPERTS_P=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
                      CHUNK=64, num_warps=8)
    return SortedAssignments(sorted_ids, block_expert, count, block_m)


# Assignments per program of the chunked sort (prompts: three launches for any count).
SORT_CHUNK = 64


def sort_chunked(chosen: torch.Tensor, num_experts: int, block_m: int) -> SortedAssignments:
    """sort_by_expert's result (the same rows and blocks) in three launches, each parallel,
    for any number of assignments: each chunk's counts per expert (and the padding), each
    expert's first rows in every chunk (and its blocks), then each chunk's assignments into
    their rows."""
    flat = chosen.reshape(-1).contiguous()
    count = flat.numel()
    rows = sorted_rows(count, num_experts, block_m)
    chunks = triton.cdiv(count, SORT_CHUNK)
    experts_p = triton.next_power_of_2(num_experts + 1)
    counts = torch.empty(chunks, experts_p, dtype=torch.int32, device=flat.device)
    totals = torch.zeros(experts_p, dtype=torch.int32, device=flat.device)
    offsets = torch.empty_like(counts)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=flat.device)
    _count_chunk[(chunks,)](flat, counts, totals, sorted_ids, count, rows,
                            triton.cdiv(rows, chunks), EXPERTS_P=experts_p, CHUNK=SORT_CHUNK)
    _chunk_offsets[(num_experts + 1,)](counts, totals, offsets, block_expert, rows, chunks,
                                       EXPERTS=num_experts, EXPERTS_P=experts_p,
                                       BLOCK_M=block_m, LANES=64)
    _place_chunk[(chunks,)](flat, offsets, sorted_ids, count, EXPERTS_P=experts_p,
                            CHUNK=SORT_CHUNK)
    return SortedAssignments(sorted_ids, block_expert, count, block_m)


# Prompt steps' tiling of the grouped GEMM, where experts average at least PROMPT_BLOCK_M
# rows: rows per block, and per weight name (BLOCK_N, BLOCK_K, warps, stages[, GROUP_M]).
# bench/moe_gemm.py chose them for qwen3-30b-a3b's experts at 2,048 and 8,192 tokens on an
# H200: 12-28% less time than 64 x 128 x 64 (bench/results/h200-moe-prompt-steps/).
PROMPT_BLOCK_M = 128
PROMPT_TILES: dict[str, tuple[int, ...]] = {"gate_up_proj": (256, 64, 8, 4),
                                            "down_proj": (256, 64, 8, 4, 8)}


@functools.cache
def _shared_memory(device_index: int) -> int:
    """The most shared memory one program may take on that GPU (opt-in), bytes."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def fits(tile: tuple[int, ...], block_m: int, element_bytes: int, shared_memory: int) -> bool:
    """Whether ``tile``'s pipeline (its stages of a BLOCK_M x BLOCK_K and a BLOCK_K x BLOCK_N
    slice) fits ``shared_memory`` bytes: the prompt tilings take 192 KiB, which Hopper has and
    an A100 or a GeForce does not."""
    block_n, block_k, _, stages = tile[:4]
    return (block_m * block_k + block_k * block_n) * element_bytes * stages <= shared_memory


# Prompt steps with the prompt tilings: SiLU-and-mul in the gate/up GEMM and the sum over each
# token's experts in one kernel (3-4% of a step; bench/prefill.py --no-moe-prompt-fusions).
PROMPT_FUSIONS = True


def block_m_for(tokens: int, rows_per_expert: float = 0.0) -> int:
    """Rows per block: 16 for decode batches up to 64 tokens (less padding per expert), 64 for
    more, PROMPT_BLOCK_M where the experts average that many rows (``rows_per_expert``)."""
    if tokens <= 64:
        return 16
    return PROMPT_BLOCK_M if rows_per_expert >= PROMPT_BLOCK_M else 64


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, groups: SortedAssignments,
                 rows_per_a: int, scale: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, scale_cols: int = 0,
                 tile: tuple[int, ...] | None = None,
                 silu_and_mul: bool = False, zeroed: bool = False) -> torch.Tensor:
    """For each assignment ``i``: row ``i // rows_per_a`` of ``a`` [rows, K] times its expert's
    ``weights`` [experts, N, K] transposed, times ``scale[i]`` if given; [assignments, N]. FP8
    ``weights`` come with ``w_scale`` [experts, N, column blocks] of ``scale_cols`` columns.
    ``tile``: (BLOCK_N, BLOCK_K, warps, stages[, GROUP_M: the program order, see
    _grouped_gemm]) in place of the defaults. ``silu_and_mul`` (16-bit gate/up weights, N gate
    rows then N up rows): SiLU(gate) * up, [assignments, N / 2], each program BLOCK_N / 2
    columns of each. ``zeroed``: rows of assignments no expert here takes are zero (else
    unspecified)."""
    assert a.stride(-1) == 1 and weights.stride(-1) == 1
    assert not (silu_and_mul and (w_scale is not None or scale is not None))
    n, k = weights.shape[1], weights.shape[2]
    width = n // 2 if silu_and_mul else n
    out = (torch.zeros if zeroed else torch.empty)(groups.assignments, width, dtype=a.dtype,
                                                   device=a.device)
    block_n, block_k = 64 if n <= 1024 else 128, 64
    launch, group_m = {}, 0
    if tile is not None:
        block_n, block_k = tile[0], tile[1]
        launch = {"num_warps": tile[2], "num_stages": tile[3]}
        group_m = tile[4] if len(tile) > 4 else 0
    if silu_and_mul:   # BLOCK_N / 2 of the gate rows and as many of the up rows a program
        n, block_n = width, block_n // 2
    row_blocks = groups.block_expert.numel()
    grid = (row_blocks * triton.cdiv(n, block_n),)
    fp8_w = w_scale is not None
    scale_cols = scale_cols or k
    w_scales = (0 if not fp8_w else 1 if scale_cols >= k
                else 2 if scale_cols % block_k == 0 else 3)
    _grouped_gemm[grid](a, weights, out, scale if scale is not None else a,
                        w_scale if fp8_w else a, groups.sorted_ids, groups.block_expert,
                        groups.assignments, n, k, rows_per_a, a.stride(0), weights.stride(0),
                        weights.stride(1), out.stride(0), w_scale.stride(0) if fp8_w else 0,
                        w_scale.stride(1) if fp8_w else 0, scale_cols, row_blocks,
                        HAS_SCALE=scale is not None, W_SCALES=w_scales, BLOCK_M=groups.block_m,
                        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                        SILU_AND_MUL=silu_and_mul, **launch)
    return out


@triton.jit
def _row_step(acc, x_row, w_rows, start, K: tl.constexpr, w_scales, scale_cols,
              W_SCALES: tl.constexpr, BLOCK_K: tl.constexpr):
    ks = start + tl.arange(0, BLOCK_K)
    values = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    w = tl.load(w_rows[:, None] + ks[None, :], mask=ks[None, :] < K, other=0.0).to(tl.float32)
    if W_SCALES == 2:
        w = w * tl.load(w_scales + start // scale_cols)[:, None]
    return acc + w * values[None, :]


@triton.jit
def _row_products(x_row, w_rows, K: tl.constexpr, w_scales, scale_cols,
                  W_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UNROLL: tl.constexpr):
    """``BLOCK_N`` weight rows (``w_rows`` their starts; FP8 with their scales' starts
    ``w_scales`` where W_SCALES is 1: one a row, or 2: one a row and ``scale_cols`` columns, a
    multiple of BLOCK_K) times one activation row, in float32. UNROLL: every step's loads at
    once (gemv_kernel.UNROLL_MAX_STEPS says for which rows)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if UNROLL:
        for start in tl.static_range(0, K, BLOCK_K):
            acc = _row_step(acc, x_row, w_rows, start, K, w_scales, scale_cols, W_SCALES,
                            BLOCK_K)
    else:
        for start in range(0, K, BLOCK_K):
            acc = _row_step(acc, x_row, w_rows, start, K, w_scales, scale_cols, W_SCALES,
                            BLOCK_K)
    out = tl.sum(acc, axis=1)
    if W_SCALES == 1:
        out = out * tl.load(w_scales)
    return out


@triton.jit
def _direct_gate_up(x, w, h, chosen, w_scale, inter, K: tl.constexpr, top_k, stride_xm,
                    stride_we, stride_wn, stride_hm, stride_se, stride_sn, scale_cols,
                    experts_here, W_SCALES: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
                    DOWN_EARLY: tl.constexpr, SKIPS: tl.constexpr):
    if DOWN_EARLY:   # the down kernel launches once every program here has waited for routing
        pdl.wait(PDL)
        pdl.start(PDL)
    else:
        pdl.start(PDL)
        pdl.wait(PDL)
    assignment = tl.program_id(0)
    expert = tl.load(chosen + assignment).to(tl.int64)
    if SKIPS:   # another rank's expert: its row is not read
        if expert >= experts_here:
            pdl.end(PDL)
            return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rows, inter - 1)   # a last, partial block recomputes the last row
    x_row = x + (assignment // top_k).to(tl.int64) * stride_xm
    # Each gate row beside its up row, read in one pass: both loads in flight together.
    pairs = tl.arange(0, 2 * BLOCK_N)
    w_rows = tl.minimum(tl.program_id(1) * BLOCK_N + pairs // 2, inter - 1) + (pairs % 2) * inter
    both = _row_products(x_row, w + expert * stride_we + w_rows.to(tl.int64) * stride_wn, K,
                         w_scale + expert * stride_se + w_rows * stride_sn, scale_cols,
                         W_SCALES, 2 * BLOCK_N, BLOCK_K, UNROLL)
    gate, up = tl.split(tl.reshape(both, [BLOCK_N, 2]))
    # Rounded as the grouped GEMM's output is, then SiLU-and-mul in float32.
    gate = gate.to(h.dtype.element_ty).to(tl.float32)
    up = up.to(h.dtype.element_ty).to(tl.float32)
    tl.store(h + assignment.to(tl.int64) * stride_hm + rows,
             (gate / (1.0 + tl.exp(-gate)) * up).to(h.dtype.element_ty))
    pdl.end(PDL)


@triton.jit
def _direct_down_sum(h, w, out, chosen, weights, hidden, stride_hm, stride_we, stride_wn,
                     stride_om, w_scale, stride_se, stride_sn, scale_cols, experts_here,
                     INTER: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr,
                     W_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, EARLY: tl.constexpr, SKIPS: tl.constexpr):
    """BLOCK_N output columns of one token: each of its experts' down rows times its SiLU-and-mul
    row, weighted, rounded and summed. Every expert's rows are loaded in one tile, reduced once:
    a reduction per expert would wait for each expert's loads in turn. EARLY: the experts and
    the first step's weights load before the wait for gate/up, which launched this kernel only
    after its own wait for the routing that wrote them (from L2: an L1 line may hold an earlier
    layer's experts at that address)."""
    pdl.start(PDL)
    if not EARLY:
        pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), hidden - 1)
    slots = tl.arange(0, TOP_K_P)
    live = slots < TOP_K
    assignment = token * TOP_K + slots
    expert = tl.load(chosen + assignment, mask=live, other=0, cache_modifier=".cg").to(tl.int64)
    if SKIPS:   # other ranks' experts add nothing here
        live = live & (expert < experts_here)
        expert = tl.where(live, expert, 0)
    w_rows = (w + expert[:, None] * stride_we + rows[None, :].to(tl.int64) * stride_wn)[:, :, None]
    h_rows = (h + assignment * stride_hm)[:, None, None]
    s_rows = w_scale + expert[:, None] * stride_se + rows[None, :] * stride_sn
    ks = tl.arange(0, BLOCK_K)[None, None, :]
    first = tl.load(w_rows + ks, mask=live[:, None, None] & (ks < INTER), other=0.0)
    if EARLY:
        pdl.wait(PDL)
    acc = tl.zeros([TOP_K_P, BLOCK_N, BLOCK_K], tl.float32)
    for start in tl.static_range(0, INTER, BLOCK_K):   # unrolled: every step's loads at once
        mask = live[:, None, None] & (start + ks < INTER)
        if start == 0:
            y = first.to(tl.float32)
        else:
            y = tl.load(w_rows + start + ks, mask=mask, other=0.0).to(tl.float32)
        if W_SCALES == 2:
            y = y * tl.load(s_rows + start // scale_cols, mask=live[:, None], other=0.0)[:, :, None]
        acc += y * tl.load(h_rows + start + ks, mask=mask, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=2)
    if W_SCALES == 1:
        y = y * tl.load(s_rows, mask=live[:, None], other=0.0)
    # Weighted and rounded as the grouped GEMM's output, summed in float32 as fused_experts
    # sums them.
    y = y * tl.load(weights + assignment, mask=live, other=0.0).to(tl.float32)[:, None]
    total = tl.sum(y.to(out.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(out + token * stride_om + rows, total.to(out.dtype.element_ty))
    pdl.end(PDL)


# Assignments (tokens times top-k) up to this many skip the sort: each reads its expert's
# weights straight from ``chosen``, SiLU-and-mul and the weighted sum fused in (two launches
# instead of six, no padded rows): decode at small batches.
DIRECT_MAX_ASSIGNMENTS = 32
# An expert two of the step's tokens chose is read twice there (once by the sorted path): the
# direct kernels take a step only where that is expected (uniform routing) to add at most this
# share to the expert weights read. qwen3-30b-a3b (top 8 of 128) takes them up to 4 tokens,
# Mixtral (top 2 of 8) up to 2 (bench/results/h200-mixtral).
DIRECT_MAX_REREAD = 0.15


def takes_direct(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a step of ``tokens`` runs its experts in the direct kernels (else sorted)."""
    assignments = tokens * top_k
    if not 0 < assignments <= DIRECT_MAX_ASSIGNMENTS:
        return False
    distinct = num_experts * (1 - (1 - top_k / num_experts) ** tokens)
    return assignments <= (1 + DIRECT_MAX_REREAD) * distinct + 1e-9


# Launched dependently, gate/up lets the down kernel launch only after its own wait for the
# routing, and down loads its experts and first weights before it waits for gate/up.
DOWN_EARLY = True
# 16-bit experts' tilings of the direct kernels by weight name, (BLOCK_N, BLOCK_K, warps), in
# place of _direct_plan's (bench/moe_direct.py sweeps them).
DIRECT_TILES: dict[str, tuple[int, int, int]] = {}


def _direct_plan(experts: torch.nn.Module, name: str, tokens: int, top_k: int
                 ) -> tuple[int, int, int, int] | None:
    """(W_SCALES, BLOCK_N, BLOCK_K, warps) of the direct kernels for weight ``name``. Gate/up:
    two rows (and their pairs) a program, 2,048 columns a step, eight warps at one token for
    16-bit experts (bench/results/h200-moe-tiles-served/; FP8 experts were slower with eight,
    bench/results/h100-megakernel-probe/). Down: two rows of every expert of a token a program,
    about 4,096 weights a step. FP8 blocks of columns: one block a step at most. None for a
    blocking they do not take."""
    k = getattr(experts, name).shape[2]
    if name == "down_proj":
        block_k = min(triton.next_power_of_2(k), max(64, 2048 // triton.next_power_of_2(top_k)))
    else:
        # 2,048 columns at 2-4 tokens too: 0.2-0.6% faster than 1,024 for 16-bit and FP8 experts.
        block_k = min(2048, triton.next_power_of_2(k))
    if not experts.quantized:
        if name in DIRECT_TILES:
            return (0, *DIRECT_TILES[name])
        # One token's gate/up streams faster with eight warps a program (h200-moe-tiles-served).
        return 0, 2, block_k, (8 if name == "gate_up_proj" and tokens == 1 else 4)
    cols = experts.scale_cols[name]
    if cols >= k:
        return 1, 2, block_k, 4
    if cols & (cols - 1) or cols < 16:
        return None
    return 2, 2, min(block_k, cols), 4


def direct_experts(x: torch.Tensor, experts: torch.nn.Module, weights: torch.Tensor,
                   chosen: torch.Tensor) -> torch.Tensor | None:
    """fused_experts' result without the sort, for few assignments; None where the experts'
    FP8 blocking is not one the kernels take."""
    tokens, top_k = chosen.shape
    gate_up, down = experts.gate_up_proj, experts.down_proj
    inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    plans = (_direct_plan(experts, "gate_up_proj", tokens, top_k),
             _direct_plan(experts, "down_proj", tokens, top_k))
    if None in plans:
        return None
    (gate_mode, gate_n, gate_k, gate_warps), (down_mode, down_n, down_k, down_warps) = plans
    x = x.contiguous()
    chosen = chosen.reshape(-1).contiguous()
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    gate_pdl, down_pdl = pdl.mode(x.device, "gate_up"), pdl.mode(x.device, "down")
    early = DOWN_EARLY and gate_pdl > 0 and down_pdl > 0
    gate_scale = experts.gate_up_proj_scale if gate_mode else gate_up
    _direct_gate_up[(tokens * top_k, triton.cdiv(inter, gate_n))](
        x, gate_up, h, chosen, gate_scale, inter, hidden, top_k, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), h.stride(0), gate_scale.stride(0) if gate_mode else 0,
        gate_scale.stride(1) if gate_mode else 0, experts.scale_cols.get("gate_up_proj", 1),
        gate_up.shape[0], W_SCALES=gate_mode, BLOCK_N=gate_n, BLOCK_K=gate_k,
        UNROLL=triton.cdiv(hidden, gate_k) <= gemv_kernel.UNROLL_MAX_STEPS, PDL=gate_pdl,
        DOWN_EARLY=early, SKIPS=experts.partial, num_warps=gate_warps,
        launch_pdl=gate_pdl > 0)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    down_scale = experts.down_proj_scale if down_mode else down
    weights = weights.reshape(-1).contiguous()
    _direct_down_sum[(tokens, triton.cdiv(hidden, down_n))](
        h, down, out, chosen, weights, hidden, h.stride(0), down.stride(0),
        down.stride(1), out.stride(0), down_scale, down_scale.stride(0) if down_mode else 0,
        down_scale.stride(1) if down_mode else 0, experts.scale_cols.get("down_proj", 1),
        down.shape[0], INTER=inter, TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k),
        W_SCALES=down_mode, BLOCK_N=down_n, BLOCK_K=down_k, PDL=down_pdl, EARLY=early,
        SKIPS=experts.partial, num_warps=down_warps, launch_pdl=down_pdl > 0)
    return out


def fused_experts(x: torch.Tensor, experts: torch.nn.Module, weights: torch.Tensor,
                  chosen: torch.Tensor, silu_and_mul) -> torch.Tensor:  # noqa: ANN001
    """Sum over each token's chosen experts of weight times expert output: ``experts`` a
    moe.Experts (16-bit or FP8), ``weights``/``chosen`` [tokens, k]. Where ``experts.partial``
    (expert parallelism), id ``num_experts`` is another rank's expert and adds nothing."""
    tokens, top_k = chosen.shape
    if takes_direct(tokens, top_k, experts.gate_up_proj.shape[0]):
        out = direct_experts(x, experts, weights, chosen)
        if out is not None:
            return out
    sort = sort_small if tokens * top_k <= SMALL_SORT_MAX else sort_chunked
    num_experts = experts.gate_up_proj.shape[0]
    block_m = block_m_for(tokens, tokens * top_k / num_experts)
    groups = sort(chosen, num_experts, block_m)
    prompt_tiles = tokens > 64 and block_m == PROMPT_BLOCK_M

    def gemm(a: torch.Tensor, name: str, rows_per_a: int,
             scale: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
        tile = PROMPT_TILES.get(name) if prompt_tiles else None
        if tile is not None and not fits(tile, block_m, a.element_size(),
                                         _shared_memory(a.device.index or 0)):
            tile = None   # the kernel's own tiling: a GPU with less shared memory than Hopper
        # Other ranks' experts' rows are summed below: zero (their gate/up rows go unread).
        zeroed = experts.partial and name == "down_proj"
        if not experts.quantized:
            return grouped_gemm(a, getattr(experts, name), groups, rows_per_a, scale, tile=tile,
                                silu_and_mul=silu, zeroed=zeroed)
        return grouped_gemm(a, getattr(experts, name), groups, rows_per_a, scale,
                            getattr(experts, name + "_scale"), experts.scale_cols[name], tile,
                            zeroed=zeroed)

    if PROMPT_FUSIONS and prompt_tiles and not experts.quantized:
        h = gemm(x.contiguous(), "gate_up_proj", top_k, silu=True)
    else:
        h = silu_and_mul(gemm(x.contiguous(), "gate_up_proj", top_k))
    h = gemm(h, "down_proj", 1, weights.reshape(-1).contiguous())
    if PROMPT_FUSIONS and prompt_tiles:
        return sum_slots(h, top_k)
    return h.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
