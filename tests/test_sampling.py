"""On-device sampling: greedy is the argmax, a seeded row draws the same tokens in any batch, the
draws follow softmax(logits / T) inside the nucleus, and nothing asks the host while sampling."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from snapkv_rag.runtime.sampling import SamplingOptions, SamplingSlots, logprobs, sample


def slots_for(options: list[SamplingOptions | None]) -> SamplingSlots:
    """Slots whose row ``i`` samples as ``options[i]`` (``None``: a free, greedy row)."""
    slots = SamplingSlots(len(options), torch.get_default_device())
    for row, option in enumerate(options):
        if option is not None:
            slots.set_row(row, option)
    return slots


def draws(logits: torch.Tensor, slots: SamplingSlots, steps: int) -> torch.Tensor:
    """``[steps, B]`` tokens sampled from the same logits step after step."""
    return torch.stack([sample(logits, slots, logits.shape[0]) for _ in range(steps)])


def test_greedy_rows_give_exactly_the_argmax_alone_and_beside_sampled_rows():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(torch.get_default_device())
    assert torch.equal(sample(logits, slots_for([None] * 4), 4), logits.argmax(-1))
    mixed = slots_for(
        [
            None,
            SamplingOptions(temperature=1.5, seed=1),
            SamplingOptions(temperature=0.0, top_p=0.5),
            SamplingOptions(temperature=2.0, top_p=0.3, seed=2),
        ]
    )
    tokens = draws(logits, mixed, 5)
    assert torch.equal(tokens[:, [0, 2]], logits.argmax(-1)[[0, 2]].expand(5, 2))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_seeded_row_draws_the_same_tokens_alone_and_inside_a_batch(top_p):
    logits = torch.randn(5, 200, generator=torch.Generator().manual_seed(1)).to(torch.get_default_device())
    mine = SamplingOptions(temperature=1.3, top_p=top_p, seed=1234)
    alone = draws(logits[3:4], slots_for([mine]), 12)[:, 0]
    others = [SamplingOptions(temperature=0.9, seed=5), None, SamplingOptions(temperature=2.0, top_p=0.5, seed=6)]
    in_batch = draws(logits, slots_for([*others, mine, SamplingOptions(temperature=1.0)]), 12)[:, 3]
    assert torch.equal(alone, in_batch)
    assert len(set(alone.tolist())) > 3  # it really sampled, not a constant token


def test_different_seeds_and_unseeded_rows_draw_different_tokens():
    logits = torch.zeros(4, 1000, device=torch.get_default_device())  # uniform: any repeat is the seed's doing
    tokens = draws(
        logits,
        slots_for([SamplingOptions(temperature=1.0, seed=s) for s in (1, 2)] + [SamplingOptions(temperature=1.0)] * 2),
        8,
    )
    columns = {tuple(tokens[:, row].tolist()) for row in range(4)}
    assert len(columns) == 4


def test_draws_follow_softmax_of_logits_over_temperature():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0], device=torch.get_default_device())
    rows, steps, temperature = 1000, 8, 0.7
    slots = slots_for([SamplingOptions(temperature=temperature, seed=seed) for seed in range(rows)])
    tokens = draws(base.expand(rows, -1), slots, steps).flatten()
    frequencies = torch.bincount(tokens, minlength=6).float() / tokens.numel()
    expected = torch.softmax(base / temperature, -1)
    bound = 0.02  # about four standard deviations of a frequency over 8,000 draws
    assert (frequencies - expected).abs().max() < bound
    # the bound is tight enough that a wrong temperature fails it
    assert (frequencies - torch.softmax(base / 1.0, -1)).abs().max() > 3 * bound
    assert (frequencies - torch.softmax(base / 0.5, -1)).abs().max() > 2 * bound


def test_top_p_never_yields_a_token_outside_the_nucleus():
    generator = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(64, 50, generator=generator)).to(torch.get_default_device())
    top_p, temperature = 0.6, 1.4
    tokens = draws(
        logits, slots_for([SamplingOptions(temperature=temperature, top_p=top_p, seed=s) for s in range(64)]), 20
    )
    probs, order = torch.softmax(logits / temperature, -1).sort(-1, descending=True)
    size = ((probs.cumsum(-1) - probs) < top_p).sum(-1)  # the smallest head whose mass reaches top_p
    for row in range(64):
        nucleus = set(order[row, : int(size[row])].tolist())
        assert set(tokens[:, row].tolist()) <= nucleus
    assert sum(len(set(tokens[:, row].tolist())) for row in range(64)) > 64 * 1.5  # more than the argmax


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_masked_tokens_are_never_sampled(top_p):
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(3)).to(torch.get_default_device())
    allowed = torch.zeros(40, dtype=torch.bool, device=logits.device)
    allowed[::5] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    tokens = draws(logits, slots_for([SamplingOptions(temperature=5.0, top_p=top_p, seed=s) for s in range(8)]), 25)
    assert allowed[tokens].all()
    assert len(set(tokens.flatten().tolist())) == 8  # every allowed token was drawn at that temperature


class HostTraffic(TorchDispatchMode):
    """Counts the aten operators that would make the host wait on the device."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.seen = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        to_host = isinstance(out, torch.Tensor) and out.device.type == "cpu" and self.device.type != "cpu"
        if name in ("_local_scalar_dense", "nonzero", "item") or to_host:
            self.seen.append(name)
        return out


def test_sampling_asks_the_host_nothing():
    logits = torch.randn(3, 500, device=torch.get_default_device())
    for options in (None, SamplingOptions(temperature=0.8, seed=1), SamplingOptions(temperature=0.8, top_p=0.7)):
        slots = slots_for([options, None, SamplingOptions(temperature=0.0)])
        with HostTraffic(logits.device) as traffic:
            tokens = sample(logits, slots, 3)
            logprobs(logits, tokens, 5)
        assert traffic.seen == [], slots.kind(3)


def test_compiled_sample_draws_the_same_tokens_as_eager():
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).to(torch.get_default_device())
    options = [
        SamplingOptions(temperature=1.1, top_p=0.9, seed=9),
        None,
        SamplingOptions(temperature=0.6, seed=10),
        SamplingOptions(temperature=1.0, top_p=0.5, seed=11),
    ]
    eager, compiled_slots = slots_for(options), slots_for(options)
    compiled = torch.compile(lambda lg, slots: sample(lg, slots, 4, "top_p"), fullgraph=True)
    for _ in range(3):
        assert torch.equal(compiled(logits, compiled_slots), sample(logits, eager, 4))
    assert torch.equal(compiled_slots.step, eager.step)
    assert compiled_slots.step.tolist() == [3, 3, 3, 3]


def test_logprobs_of_the_chosen_and_the_most_likely_tokens():
    logits = torch.randn(2, 30, device=torch.get_default_device())
    logits[1, 7:] = float("-inf")  # a grammar mask: the masked tokens have no probability
    tokens = torch.tensor([4, 2], device=logits.device)
    chosen, top_ids, top_logprobs = logprobs(logits, tokens, 3)
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, reference[[0, 1], [4, 2]])
    assert torch.equal(top_ids, reference.topk(3, -1).indices)
    assert (top_logprobs[:, :-1] >= top_logprobs[:, 1:]).all()
    assert torch.allclose(torch.exp(reference[1, :7]).sum(), torch.tensor(1.0, device=logits.device))
    assert logprobs(logits, tokens, 0)[1].shape == (2, 0)


def test_bad_settings_get_clear_errors():
    with pytest.raises(ValueError, match="max_rows"):
        SamplingSlots(0)
    slots = SamplingSlots(2)
    with pytest.raises(ValueError, match="row"):
        slots.set_row(2, SamplingOptions())
    with pytest.raises(TypeError, match="options"):
        slots.set_row(0, {"temperature": 1.0})
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(3, 10), slots, 3)
    with pytest.raises(ValueError, match="kind"):
        sample(torch.zeros(2, 10), slots, 2, kind="beam")
    with pytest.raises(ValueError, match="k:"):
        logprobs(torch.zeros(2, 10), torch.zeros(2, dtype=torch.long), 11)
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions(top_p=0)


def test_noise_is_finite_at_the_extremes_of_the_hash():
    """A uniform of exactly 0 or 1 makes infinite Gumbel noise, and inf + a masked token's -inf is NaN,
    which argmax picks: a grammar-masked token then wins (seen with a 2-token mask at top_p 0.95)."""
    from snapkv_rag.runtime.sampling import _uniform

    extremes = _uniform(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64))
    assert bool(((extremes > 0) & (extremes < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(extremes))).all())
