"""8-bit AdamW, by hand: both Adam moments stored as one byte per parameter.

Used by judge_train_cuda.py (--paged too) and bench/judge.py. The one idea: Adam's moments are
smooth and need relative, not absolute, precision, so store them the way bitsandbytes does:
cut each moment into blocks of 256 values, keep one fp32 absmax per block, and store every value
divided by its block's absmax as the index (uint8) of the nearest entry of a 256-entry "dynamic"
code table whose entries are spread over seven decades (1e-7 .. 1), a few bits of exponent and a
shrinking fraction. Each step dequantises the block (a table lookup and a multiply), runs the
ordinary fp32 AdamW update, and quantises the new moments again. State: 2 bytes + 8/256 bytes of
absmaxes per parameter, about 2.03 bytes instead of fp32 AdamW's 8.

Details that follow bitsandbytes (bnb.optim.AdamW8bit, optim_bits=8, block-wise):
- the first moment (signed) and second moment (non-negative) use create_dynamic_map(signed=True)
  and create_dynamic_map(signed=False); tests/fixtures/adam8bit_golden.json holds both tables as
  the real bitsandbytes builds them (made by tests/fixtures/make_adam8bit_golden.py);
- a tensor with fewer than 4,096 elements (min_8bit_size) keeps fp32 moments: biases, norms and
  small LoRA matrices cost little in fp32;
- a quantised first moment keeps its sign: a negative value that would round to the 0 entry goes
  to the smallest negative entry (0 counts as positive, as in bitsandbytes' sign-bit check, so a
  tiny positive value may still round to 0), so tiny momenta never flip the direction of an update.
Weight decay is decoupled (AdamW) and applied before the update, as torch.optim.AdamW does
(bitsandbytes multiplies after; the difference is lr * wd * update, far below the 8-bit noise).

paged=True is the portable stand-in for bitsandbytes' paged optimizers: for a CUDA parameter the
states live in pinned (page-locked) CPU memory and are copied to the GPU for that parameter's
update and back after it, so the GPU holds one parameter's state at a time. bitsandbytes instead
allocates CUDA unified memory that the driver pages out only under memory pressure. For a CPU
parameter paged=True changes nothing: the state is in CPU memory already.
"""

import math

import torch
import torch.nn.functional as F

from lib import exercise

BLOCK_SIZE = 256
# bitsandbytes' min_8bit_size; 0 while the adam8bit exercise runs, so that the small LoRA matrices of a tiny demo
# (judge_train_cuda.py --model tiny) go through the learner's 8-bit code too.
MIN_8BIT_SIZE = 0 if "adam8bit" in exercise.chosen() else 4096
CHUNK = 2**18  # elements updated at once: 1 MiB fp32 temporaries, measured fastest on a CPU


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The 256-entry dynamic quantisation table of Dettmers (2015) as bitsandbytes builds it.

    Decade i (i = 0 .. 6, values 10^(i-6) x [0.1, 1)) gets 2^i evenly spread entries per sign when
    signed, 2^(i+1) when not (the sign bit is spent on precision instead): the entries are the
    midpoints of 2^i + 1 (or 2^(i+1) + 1) points evenly spaced over [0.1, 1], times 10^(i-6).
    Small decades get few entries, large ones many: the worst relative error is a few percent in
    the top decade and grows decade by decade below it (docs/adam8bit_explained.md tabulates it).
    Add 0 and 1, sort, and the 256 codes are the sorted positions. Computed in float32
    in the same order as bitsandbytes so that every entry is bit-for-bit the same.
    """
    values = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        n = 2 ** (i + non_sign_bits - max_exponent_bits) * (1 if signed else 2)
        edges = torch.linspace(0.1, 1, n + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        values += (scale * mids).tolist()
        if signed:
            values += (-scale * mids).tolist()
    # With 7 exponent bits of 8 there is no purely linear region left (bitsandbytes' "additional
    # items" are 2^0 - 1 = 0), so 254 entries + 0 + 1 fill the table exactly.
    values += [0.0, 1.0]
    values += [0.0] * (2 ** total_bits - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


# Rounding to the nearest table entry without a binary search. torch.bucketize costs a branchy
# search per element (slower than the whole AdamW update), so the search is done once, ahead of
# time, for every possible float "bucket": the sign, the 8 exponent bits and the top LUT_BITS
# mantissa bits of a float32 (its bit pattern shifted right) name a narrow interval of values, and
# LUT[bucket] is the code of the interval's lowest value. With 7 mantissa bits an interval is
# narrower than the table's spacing, so at most one rounding boundary lies inside it (asserted when
# the table is built): the code of v is LUT[bucket], plus one if v is past the next boundary. Two
# gathers and a compare per element.
LUT_BITS = 7
_MAPS: dict = {}


def _float_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (0 .. 2^32 - 1) -> the float32 values they encode."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _rounding_tables(table: torch.Tensor, signed: bool):
    """(boundaries padded with +inf, LUT from float bucket to code of its lowest value) for one table."""
    mids = (table[1:] + table[:-1]) / 2
    if signed:
        # The boundary between the smallest negative entry and 0 moves to just below zero, so a
        # negative momentum down to float32's smallest normal number never rounds to 0 and loses its
        # sign (bitsandbytes' kernel does the same with a sign-bit check after rounding, which moves
        # even subnormal ones); an exact 0 still rounds to 0.
        zero = int((table == 0).nonzero()[0])
        mids[zero - 1] = -torch.finfo(torch.float32).tiny
    shift = 23 - LUT_BITS
    buckets = torch.arange(2 ** (9 + LUT_BITS), dtype=torch.int64)
    ends = torch.stack([_float_of_bits(buckets << shift), _float_of_bits((buckets << shift) | (2**shift - 1))])
    sign = torch.where(buckets >= 2 ** (8 + LUT_BITS), -1.0, 1.0)
    ends = torch.where(ends.isnan(), sign, ends).clamp(-1.0, 1.0)  # normalised values lie in [-1, 1]
    low, high = ends.amin(0), ends.amax(0)  # a negative bucket's first bit pattern is its largest value
    lut = torch.bucketize(low, mids)  # the binary search, once per bucket instead of once per element
    assert int((torch.bucketize(high, mids) - lut).max()) <= 1, "LUT_BITS too small for this table"
    padded = torch.cat([mids, torch.tensor([float("inf")])])  # past the last entry: never rounds up
    return padded, lut.to(torch.int32)


def dynamic_maps(device) -> dict:
    """For 'signed' and 'unsigned': the table, its padded rounding boundaries and the bucket LUT."""
    key = str(device)
    if key not in _MAPS:
        maps = {}
        for name, signed in (("signed", True), ("unsigned", False)):
            table = create_dynamic_map(signed)
            mids, lut = _rounding_tables(table, signed)
            maps[name] = (table.to(device), mids.to(device), lut.to(device))
        _MAPS[key] = maps
    return _MAPS[key]


def round_to_table(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Codes (int32) of the nearest table entries to x (values in [-1, 1]), ties to the lower entry."""
    _, mids, lut = dynamic_maps(x.device)["signed" if signed else "unsigned"]
    flat = x.reshape(-1)
    buckets = (flat.view(torch.int32) >> (23 - LUT_BITS)) & (2 ** (9 + LUT_BITS) - 1)
    codes = lut.index_select(0, buckets)
    return (codes + (flat > mids.index_select(0, codes))).view_as(x)


def quantize_blockwise(x: torch.Tensor, signed: bool, block_size: int = BLOCK_SIZE):
    """fp32 [n] -> (uint8 codes [n], fp32 absmax [ceil(n / block_size)]): nearest table entry of x / absmax."""
    n = x.numel()
    blocks = x.reshape(-1)
    if n % block_size:
        blocks = F.pad(blocks, (0, -n % block_size))
    blocks = blocks.view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    return round_to_table(normed, signed).reshape(-1)[:n].to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """uint8 [n] + fp32 absmax -> fp32 [n_blocks, block_size] (zero-padded past n)."""
    table = dynamic_maps(codes.device)["signed" if signed else "unsigned"][0]
    values = table.index_select(0, codes.int())  # a uint8 index tensor would mean a boolean mask
    if codes.numel() % block_size:
        values = F.pad(values, (0, -codes.numel() % block_size))
    return values.view(-1, block_size) * absmax[:, None]


def adamw_fp32_step(w, g, m, v, step, lr, betas, eps, weight_decay):
    """One AdamW step in place on flat fp32 tensors: moments m, v (fp32) and weights w, gradient g."""
    (beta1, beta2), step_size = betas, lr / (1 - betas[0] ** step)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    # AdamW: decay decoupled from the gradient, then the bias-corrected Adam step.
    if weight_decay:
        w.mul_(1 - lr * weight_decay)
    # m / denominator first, then the step size: addcdiv_'s value= must fit in fp32, and an absurd
    # --lr (1e38) should make the weights inf, which the run then refuses to save, not a traceback.
    d = v.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
    w.sub_(torch.div(m, d, out=d).mul_(step_size))  # the quotient in the denominator's buffer


def adamw8bit_update(w, g, state1, absmax1, state2, absmax2, step, lr, betas, eps, weight_decay,
                     block_size=BLOCK_SIZE):
    """One AdamW step on flat fp32 weights w (in place) whose moments are stored in 8 bits.

    state1/absmax1 hold the first moment (signed map), state2/absmax2 the second (unsigned map), as
    quantize_blockwise returns them, one absmax per block of w. Dequantise both, run the fp32 AdamW
    step (adamw_fp32_step), and write the new moments' codes and absmaxes back into the four tensors.
    """
    n = w.numel()
    m = dequantize_blockwise(state1, absmax1, True, block_size).view(-1)[:n]
    v = dequantize_blockwise(state2, absmax2, False, block_size).view(-1)[:n]
    adamw_fp32_step(w, g, m, v, step, lr, betas, eps, weight_decay)
    for codes, absmax, moment, signed in ((state1, absmax1, m, True), (state2, absmax2, v, False)):
        new_codes, new_absmax = quantize_blockwise(moment, signed, block_size)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)


# An exercise (exercises/adam8bit.py) may stand in for these three (BYHAND_EXERCISE=adam8bit).
quantize_blockwise = exercise.swap("adam8bit", quantize_blockwise)
dequantize_blockwise = exercise.swap("adam8bit", dequantize_blockwise)
adamw8bit_update = exercise.swap("adam8bit", adamw8bit_update)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are block-wise 8-bit (tensors of >= min_8bit_size elements) or fp32.

    Per-parameter state: "step" (int); 8-bit: "state1"/"state2" (uint8 codes, one per element) and
    "absmax1"/"absmax2" (fp32, one per block); fp32: "exp_avg"/"exp_avg_sq". state_dict() and
    load_state_dict() round-trip them exactly (the codes are integers, the absmaxes stay fp32).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block_size=BLOCK_SIZE, min_8bit_size=MIN_8BIT_SIZE, paged=False):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"AdamW8bit: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW8bit: betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.block_size, self.min_8bit_size, self.paged = block_size, min_8bit_size, paged

    def _state_device(self, p):
        # Paged: CUDA parameters keep their state in pinned host memory; everything else beside p.
        return torch.device("cpu") if self.paged and p.is_cuda else p.device

    def _new_state_tensor(self, p, t):
        t = t.to(self._state_device(p))
        return t.pin_memory() if self.paged and p.is_cuda else t

    def _init_state(self, p, state):
        state["step"] = 0
        if p.numel() >= self.min_8bit_size:
            n_blocks = -(-p.numel() // self.block_size)
            zero_code = int((create_dynamic_map(True) == 0).nonzero()[0])
            state["state1"] = self._new_state_tensor(p, torch.full((p.numel(),), zero_code, dtype=torch.uint8))
            state["state2"] = self._new_state_tensor(p, torch.zeros(p.numel(), dtype=torch.uint8))  # entry 0 is 0.0
            state["absmax1"] = self._new_state_tensor(p, torch.zeros(n_blocks))
            state["absmax2"] = self._new_state_tensor(p, torch.zeros(n_blocks))
        else:
            state["exp_avg"] = self._new_state_tensor(p, torch.zeros(p.numel()))
            state["exp_avg_sq"] = self._new_state_tensor(p, torch.zeros(p.numel()))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                self._update(p, state, group)
        return loss

    def _update(self, p, state, group):
        lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        t, n = state["step"], p.numel()
        grad = p.grad.reshape(-1)
        p32 = p.detach().reshape(-1)
        if p32.dtype != torch.float32 or p32.data_ptr() != p.data_ptr():
            p32 = p32.float()  # bf16/fp16 (or non-contiguous) parameters: update an fp32 copy
        eight_bit = "state1" in state
        # Paged: this parameter's state comes to the GPU now and goes back below (one at a time).
        names = ("state1", "absmax1", "state2", "absmax2") if eight_bit else ("exp_avg", "exp_avg_sq")
        local = {k: state[k].to(p.device, non_blocking=True) for k in names}
        # Chunks of whole blocks keep the temporaries small (cache-sized, reused by the allocator).
        for start in range(0, n, CHUNK):
            end = min(start + CHUNK, n)
            g, w = grad[start:end].float(), p32[start:end]
            if eight_bit:
                blocks = slice(start // self.block_size, -(-end // self.block_size))
                adamw8bit_update(w, g, local["state1"][start:end], local["absmax1"][blocks], local["state2"][start:end],
                                 local["absmax2"][blocks], t, lr, betas, eps, wd, self.block_size)
            else:
                m, v = local["exp_avg"][start:end], local["exp_avg_sq"][start:end]
                adamw_fp32_step(w, g, m, v, t, lr, betas, eps, wd)
        if p32.data_ptr() != p.data_ptr():
            p.copy_(p32.view_as(p))
        for k in names:
            if local[k].data_ptr() != state[k].data_ptr():
                state[k].copy_(local[k])  # paged: back to pinned host memory

    def load_state_dict(self, state_dict):
        """torch.optim.Optimizer.load_state_dict, then each state tensor put back as it was saved.

        The base class casts floating-point state to the parameter's dtype and moves it to the
        parameter's device; our absmaxes must stay fp32 (a bf16 absmax would shift every value of
        its block) and paged state must stay in pinned host memory.
        """
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value):
                    self.state[p][key] = self._new_state_tensor(p, value.clone())

    def state_bytes(self, where: str = "all") -> int:
        """Bytes of optimizer state: 'all', or only what sits on 'device' (the GPU for paged) / 'host'."""
        total = 0
        for state in self.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    on_host = value.device.type == "cpu"
                    if where == "all" or (where == "host") == on_host:
                        total += value.numel() * value.element_size()
        return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state of any optimizer (torch.optim.AdamW: 2 x 4 bytes per parameter + step)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
