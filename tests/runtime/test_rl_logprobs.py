"""Sampled tokens' logprobs: the engine's (`SamplingParams(logprobs=0)`) equal the trainer's recomputation
(`fxrewrite.rl.completion_logprobs` on the optimized model) and stock transformers' log_softmax in float32, and under `batch_invariant=True`
a sequence's logprobs are bitwise the same alone and batched with others."""

from types import SimpleNamespace

import pytest
import torch

import fxrewrite
from fxrewrite.rl import completion_logprobs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17", "The capital", "a b c d e f"]


def _sampled(outputs):
    """[(prompt ids, completion ids, engine logprobs of the completion)] of every completion."""
    out = []
    for o in outputs:
        for c in o.outputs:
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
            out.append((list(o.prompt_token_ids), list(c.token_ids), lps))
    return out


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return str(tiny_model_dir("qwen3", vocab="smollm2"))


@pytest.mark.parametrize("impl", ["transformers", "native"])
def test_engine_logprobs_equal_trainer_recomputation_float32(path, impl):
    from transformers import AutoModelForCausalLM

    llm = LLM(path, model_impl=impl, dtype="float32", block_size=4, max_num_batched_tokens=16)  # chunked prefill
    params = SamplingParams(temperature=1.0, n=2, seed=3, logprobs=0, max_tokens=10, ignore_eos=True)
    samples = _sampled(llm.generate(PROMPTS, params, use_tqdm=False))
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    recomputed = completion_logprobs(trainer, [p for p, _, _ in samples], [c for _, c, _ in samples],
                                     micro_batch_size=3)
    assert len(samples) == len(recomputed) == 2 * len(PROMPTS)
    for (prompt, completion, engine), mine in zip(samples, recomputed, strict=True):
        assert len(engine) == 10
        torch.testing.assert_close(torch.tensor(engine), mine.detach(), rtol=0, atol=1e-5)
        # the independent oracle: transformers' own model, its logits, log_softmax at each completion token
        with torch.no_grad():
            logits = stock(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        oracle = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(engine), oracle, rtol=0, atol=1e-5)


def test_recomputation_has_gradients_and_checks_lengths(path):
    from transformers import AutoModelForCausalLM

    model = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    lps = completion_logprobs(model, [[1, 2, 3]], [[4, 5]])
    lps[0].sum().backward()
    assert lps[0].shape == (2,) and model.model.norm.weight.grad is not None
    with pytest.raises(ValueError, match="prompts"):
        completion_logprobs(model, [[1]], [])
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"completion 0: token id {vocab} is outside the model's vocabulary "
                                         rf"\[0, {vocab}\)"):
        completion_logprobs(model, [[1]], [[vocab]])  # was torch's bare IndexError (a fresh user's find)
    with pytest.raises(ValueError, match=r"completion 0: token ids must be integers; got 4.5"):
        completion_logprobs(model, [[1]], [[4.5]])  # the fused path had read it as 4
    with pytest.raises(ValueError, match=r"prompt 0: token ids must be integers; got torch.float32"):
        completion_logprobs(model, [torch.tensor([1.0])], [[4]])
    ids = torch.tensor([4, 5])
    torch.testing.assert_close(completion_logprobs(model, [torch.tensor([1, 2, 3])], [list(ids)])[0], lps[0])


@pytest.mark.parametrize("impl", ["transformers", "native"])
def test_batch_invariant_logprobs_bitwise_alone_and_batched(path, impl):
    llm = LLM(path, model_impl=impl, dtype="float32", block_size=4, batch_invariant=True)
    target = SamplingParams(temperature=1.0, seed=11, logprobs=0, max_tokens=12, ignore_eos=True)
    alone = _sampled(llm.generate([PROMPTS[1]], target, use_tqdm=False))
    others = [SamplingParams(temperature=1.0, seed=s, logprobs=0, max_tokens=m, ignore_eos=True)
              for s, m in ((1, 5), (2, 16), (3, 9))]
    assert llm.reset_prefix_cache() is True  # vLLM's return; the target's prompt is prefilled again, batched
    batched = _sampled(llm.generate(PROMPTS, [others[0], target, others[1], others[2]], use_tqdm=False))
    assert batched[1][1] == alone[0][1]
    assert batched[1][2] == alone[0][2]  # bitwise: float equality of every logprob


def test_batch_invariant_seeded_siblings_repeat_across_prefix_cache_hits_bf16(default_model_dir):
    """n=2 with a seed on the default model in bf16: the first request prefills both siblings, the repeat hits
    the prefix cache and computes only the tail. By default bf16 rounds differently on the two paths (the first
    token's logprob: -1.186 vs -1.202 on torch 2.13's CPU, and a sibling's text can change); with
    batch_invariant=True every completion repeats bit for bit."""
    llm = LLM(str(default_model_dir), dtype="bfloat16", batch_invariant=True, kv_cache_memory_bytes=16 << 20,
              max_model_len=512)
    params = SamplingParams(temperature=1.0, n=2, seed=7, logprobs=0, max_tokens=8)
    messages = [{"role": "user", "content": "Tell me a story about cats and dogs"}]
    first = _sampled(llm.chat(messages, params, use_tqdm=False))
    assert _sampled(llm.chat(messages, params, use_tqdm=False)) == first


def test_fused_head_logprobs_and_gradients_equal_full_logits(path, monkeypatch):
    """The optimized model's logits-free path (hidden states -> chunked LM head on completion positions)
    against the model's own logits + log_softmax: values and per-token weighted gradients, float32."""
    from transformers import AutoModelForCausalLM

    from fxrewrite import rl

    model = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).train()
    assert rl.fused_head(model) is not None and rl.fused_head(model, temperature=0.7) is not None
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    completions = [[20, 21, 22, 23], [], [24, 25, 26, 27, 28, 29, 30]]
    old = [torch.randn(len(c), generator=gen) * 0.1 - 3 for c in completions]
    adv = torch.tensor([0.5, -1.0, 1.5])

    def run(temperature):
        model.zero_grad(set_to_none=True)
        new = completion_logprobs(model, prompts, completions, micro_batch_size=2, temperature=temperature)
        rl.grpo_loss(new, old, adv).backward()
        return [n.detach() for n in new], {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    for temperature in (1.0, 0.7):
        fused, fused_grads = run(temperature)
        with monkeypatch.context() as m:
            m.setattr(rl, "fused_head", lambda *a, **k: None)  # the logits path
            full, full_grads = run(temperature)
        assert [len(x) for x in fused] == [4, 0, 7]
        for a, b in zip(fused, full):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert fused_grads.keys() == full_grads.keys() and len(full_grads) == len(list(model.parameters()))
        for k in full_grads:
            torch.testing.assert_close(fused_grads[k], full_grads[k], rtol=1e-5, atol=1e-5, msg=k)


def test_peft_model_optimized_takes_the_fused_head_with_its_adapters(path):
    """A PEFT LoRA model passed through optimize (the README's order): completion_logprobs and
    completion_grpo_loss read it through get_base_model() (before, the PeftModel's `model` attribute was taken
    for the base and its output had no last_hidden_state), the adapters run (an adapter's change moves the
    logprobs), and the values equal the model's own logits' log_softmax."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from fxrewrite import rl

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = fxrewrite.optimize(peft.get_peft_model(stock, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
    assert rl.fused_head(model) is not None
    prompts, completions = [[5, 6, 7], [8, 9]], [[20, 21, 22], [23, 24]]
    with torch.no_grad():
        ids = torch.tensor([prompts[0] + completions[0]])
        want = torch.log_softmax(model(input_ids=ids).logits[0, 2:5].float(), -1).gather(1, ids[0, 3:6, None])[:, 0]
        got = completion_logprobs(model, prompts, completions)
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
        assert not torch.allclose(completion_logprobs(model, prompts, completions)[0], got[0])
    loss, _ = rl.completion_grpo_loss(model, prompts, completions, torch.tensor([1.0, -1.0]))
    loss.backward()
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


def test_fused_head_looks_through_compile_and_refuses_prompt_learning(path):
    """torch.compile(optimized) keeps the logits-free path (its base runs eagerly); a prompt-tuning PEFT model,
    whose virtual tokens only the PeftModel's forward adds, takes the logits path, and its logprobs equal its own
    logits' log_softmax."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from fxrewrite import rl

    model = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    assert rl.fused_head(torch.compile(model)) is not None
    prompted = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert rl.fused_head(prompted) is None
    with torch.no_grad():
        for name, param in prompted.named_parameters():
            if "prompt_encoder" in name:
                param.normal_()
        ids = torch.tensor([[5, 6, 7, 20, 21, 22]])
        logits = prompted(input_ids=ids).logits[0, -4:-1]  # the virtual tokens come first
        want = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 3:, None])[:, 0]
        torch.testing.assert_close(completion_logprobs(prompted, [[5, 6, 7]], [[20, 21, 22]])[0], want,
                                   rtol=1e-5, atol=1e-5)


def test_hooked_head_or_model_takes_the_logits_path(path):
    """A fresh user's find: the logits-free path called neither the causal LM nor its head, so a forward hook on
    `lm_head` (masking tokens to -inf), a pre-hook on it or a hook on the model itself was silently left out of the
    logprobs (5% off). Now each sends the call through the model's logits, whose hooks run: the logprobs equal the
    hooked stock-style log_softmax of `model(...).logits`, and `completion_grpo_loss` too. So does a forward put on
    the model's instance (accelerate's autocast wrapper: the fused path had run without it)."""
    from transformers import AutoModelForCausalLM

    from fxrewrite import rl

    model = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).train()
    prompts, completions = [[5, 6, 7], [8]], [[20, 21], [22, 23, 24]]

    def masked(module, args, out):
        return out.masked_fill(torch.arange(out.shape[-1]) >= 100, float("-inf"))

    def halved(module, args, out):
        out.logits = out.logits * 0.5
        return out

    def wrapped(*args, **kwargs):  # a forward put on the instance, as accelerate's autocast wrapper is
        return halved(model, args, type(model).forward(model, *args, **kwargs))

    def instance_forward():
        model.forward = wrapped
        return SimpleNamespace(remove=lambda: delattr(model, "forward"))

    for install in (lambda: model.lm_head.register_forward_hook(masked),
                    lambda: model.lm_head.register_forward_pre_hook(lambda m, args: (args[0] * 2,)),
                    lambda: model.register_forward_hook(halved), instance_forward):
        handle = install()
        try:
            assert rl.fused_head(model) is None
            with torch.no_grad():
                got = completion_logprobs(model, prompts, completions)
                for p, c, lp in zip(prompts, completions, got, strict=True):
                    logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
                    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c)[:, None])[:, 0]
                    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
                loss, new = rl.completion_grpo_loss(model, prompts, completions, torch.tensor([1.0, -1.0]))
                for a, b in zip(new, got, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        finally:
            handle.remove()
    assert rl.fused_head(model) is not None  # unhooked again: the fused path


def test_grpo_loss_matches_per_sequence_formula():
    from fxrewrite.rl import grpo_loss

    gen = torch.Generator().manual_seed(1)
    new = [torch.randn(n, generator=gen) for n in (3, 0, 5)]
    old = [x + torch.randn(x.shape, generator=gen) * 0.3 for x in new]
    adv = torch.tensor([1.0, -2.0, 0.5])
    per = [-torch.minimum(torch.exp(n - o) * a, torch.exp(n - o).clamp(0.8, 1.2) * a) for n, o, a in zip(new, old, adv)]
    torch.testing.assert_close(grpo_loss(new, old, adv), torch.cat(per).mean())


def test_grpo_inputs_are_checked_and_an_empty_batch_is_zero():
    """Fresh user's finds: every completion empty gave NaN (an empty mean), group_size 0 a ZeroDivisionError,
    mismatched counts torch's shape errors."""
    from fxrewrite.rl import grpo_advantages, grpo_loss

    empty = [torch.zeros(0, requires_grad=True), torch.zeros(0, requires_grad=True)]
    loss = grpo_loss(empty, [torch.zeros(0), torch.zeros(0)], torch.tensor([1.0, -1.0]))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    for group_size in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="group_size=.*expected a positive integer"):
            grpo_advantages(torch.ones(4), group_size)
    with pytest.raises(ValueError, match="2 new logprobs, 1 old logprobs and 2 advantages"):
        grpo_loss([torch.zeros(2)] * 2, [torch.zeros(2)], torch.ones(2))
    with pytest.raises(ValueError, match="completion 1: 3 new logprobs and 2 old ones"):
        grpo_loss([torch.zeros(2), torch.zeros(3)], [torch.zeros(2), torch.zeros(2)], torch.ones(2))


@pytest.mark.parametrize("on_policy", [False, True])
def test_completion_grpo_loss_equals_logprobs_then_loss(path, monkeypatch, on_policy):
    """The loss with the LM head's gradients made in the forward (`completion_grpo_loss` on an optimized model)
    against the straightforward `grpo_loss(completion_logprobs(...))` through the model's logits: loss, new
    logprobs and every parameter's gradient, float32; with the engine's old logprobs (some ratios clipped) and
    on-policy (old = new detached, ratio 1)."""
    from transformers import AutoModelForCausalLM

    from fxrewrite import rl

    model = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).train()
    gen = torch.Generator().manual_seed(2)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16]]
    completions = [[20, 21, 22, 23], [], [24, 25, 26, 27, 28, 29, 30], [31, 32]]
    adv = torch.tensor([0.5, -1.0, 1.5, -0.7])
    with torch.no_grad():
        base = completion_logprobs(model, prompts, completions)
    old = None if on_policy else [b + torch.randn(b.shape, generator=gen) * 0.3 for b in base]

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss, new = fn()
        (loss * 0.6).backward()
        return loss.detach(), new, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    def straightforward():
        new = completion_logprobs(model, prompts, completions, micro_batch_size=3)
        return rl.grpo_loss(new, old or [n.detach() for n in new], adv), [n.detach() for n in new]

    fused = run(lambda: rl.completion_grpo_loss(model, prompts, completions, adv, old, micro_batch_size=3))
    with monkeypatch.context() as m:
        m.setattr(rl, "fused_head", lambda *a, **k: None)  # the logits path
        want = run(straightforward)
    torch.testing.assert_close(fused[0], want[0], rtol=1e-5, atol=1e-6)
    assert [len(x) for x in fused[1]] == [4, 0, 7, 2] and not any(x.requires_grad for x in fused[1])
    for a, b in zip(fused[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fused[2].keys() == want[2].keys() and len(want[2]) == len(list(model.parameters()))
    for k in want[2]:
        torch.testing.assert_close(fused[2][k], want[2][k], rtol=1e-5, atol=1e-5, msg=k)
    with pytest.raises(ValueError, match="advantages"):
        rl.completion_grpo_loss(model, prompts, completions, adv[:2])
    if not on_policy:  # one old logprob moved to the next completion: offsets had shifted silently (a fresh user's)
        shifted = [torch.cat([old[0], old[2][:1]]), old[1], old[2][1:], old[3]]
        with pytest.raises(ValueError, match="completion 0: 4 new logprobs and 5 old ones"):
            rl.completion_grpo_loss(model, prompts, completions, adv, shifted)
        with pytest.raises(ValueError, match="completion 0: old logprobs list .*expected a float tensor"):
            rl.completion_grpo_loss(model, prompts, completions, adv, [o.tolist() for o in old])
        vocab = model.get_input_embeddings().num_embeddings
        with pytest.raises(ValueError, match=rf"completion 3: token id {vocab} is outside"):  # was a bare IndexError
            rl.completion_grpo_loss(model, prompts, completions[:3] + [[31, vocab]], adv, old)
