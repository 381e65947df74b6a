"""`LLM.load_weights`: in-place updates from an optimized model (fused names), a stock model (Hugging Face
names) or pairs; bad input leaves the old weights; the prefix cache is dropped."""

import pytest
import torch

import fxrewrite
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

SMALL_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # not 128 of 768

PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _hf(path, optimize):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return fxrewrite.optimize(model) if optimize else model


@pytest.fixture(scope="module")
def dirs(tiny_model_dir):
    return tiny_model_dir("qwen3", vocab="smollm2"), tiny_model_dir("qwen3", vocab="smollm2", seed=1)


@pytest.fixture(scope="module")
def reference(dirs):
    """Greedy tokens of an engine started on the second folder's weights."""
    return _tokens(LLM(str(dirs[1]), model_impl="native", dtype="float32", block_size=4))


def _snapshot(llm):
    return {n: (p.data_ptr(), p.detach().clone()) for n, p in llm.llm_engine.model_runner.model.named_parameters()}


@pytest.mark.parametrize("impl, optimized", [("transformers", True), ("transformers", False), ("native", True),
                                             ("native", False)])
def test_sync_from_model_equals_engine_started_on_it(dirs, reference, impl, optimized):
    llm = LLM(str(dirs[0]), model_impl=impl, dtype="float32", block_size=4)
    before_tokens = _tokens(llm)  # fills the prefix cache with the old weights' K/V
    assert llm.llm_engine.block_manager.hash_to_block_id
    before = _snapshot(llm)
    names = llm.load_weights(_hf(dirs[1], optimized))
    assert names == set(before)
    assert not llm.llm_engine.block_manager.hash_to_block_id
    after = _snapshot(llm)
    assert all(after[n][0] == before[n][0] for n in before), "a parameter was reallocated"
    assert any(not torch.equal(after[n][1], before[n][1]) for n in before)
    assert _tokens(llm) == reference != before_tokens


@pytest.mark.parametrize("wrap", ["plain", "compiled"])
def test_an_unfused_engine_takes_an_optimized_model(dirs, reference, wrap):
    """transformers with fusion=False keeps HF's q/k/v and gate/up modules: an optimized trainer (also under
    torch.compile) arrives split into them (a fresh user got "nothing was updated": qkv_proj matched nothing)."""
    llm = LLM(str(dirs[0]), model_impl="transformers", fusion=False, dtype="float32", block_size=4)
    model = _hf(dirs[1], True)
    names = llm.load_weights(torch.compile(model) if wrap == "compiled" else model)
    assert names == {n for n, _ in llm.llm_engine.model_runner.model.named_parameters()}
    assert _tokens(llm) == reference


def test_a_data_parallel_wrapped_trainer_syncs_as_the_model_it_holds(dirs, reference):
    """A trainer's model in its DataParallel / DDP wrapper (names under ``module.``) syncs as the model itself (it
    was refused: every name unknown)."""
    llm = LLM(str(dirs[0]), model_impl="native", dtype="float32", block_size=4)
    wrapped = torch.nn.DataParallel(_hf(dirs[1], True))
    assert next(iter(dict(wrapped.named_parameters()))).startswith("module.")
    assert llm.load_weights(wrapped) == {n for n, _ in llm.llm_engine.model_runner.model.named_parameters()}
    assert _tokens(llm) == reference


@pytest.mark.parametrize("stock_as", ["model", "pairs"])
def test_native_moe_takes_hf_names(tiny_model_dir, stock_as):
    """The native Qwen3-MoE (its packed_modules_mapping keys written with their dots) takes a stock model or its
    state_dict pairs, as the dense one does."""
    old, new = (tiny_model_dir("qwen3_moe", vocab="smollm2", seed=s, **SMALL_MOE) for s in (0, 1))
    llm = LLM(str(old), model_impl="native", dtype="float32", block_size=4)
    stock = _hf(new, False)
    names = llm.load_weights(stock if stock_as == "model" else list(stock.state_dict().items()))
    assert names >= {n for n, _ in llm.llm_engine.model_runner.model.named_parameters()}  # + a tied head
    assert _tokens(llm) == _tokens(LLM(str(new), model_impl="native", dtype="float32", block_size=4))


def test_pairs_with_hf_names_and_fused_names_mixed(dirs, reference):
    llm = LLM(str(dirs[0]), model_impl="transformers", dtype="float32", block_size=4)
    hf_names = list(_hf(dirs[1], False).state_dict().items())  # tied lm_head.weight included
    fused = dict(_hf(dirs[1], True).named_parameters())
    q = [(n, t) for n, t in hf_names if ".q_proj." in n or ".k_proj." in n or ".v_proj." in n]
    others = [(n, t) for n, t in fused.items() if "qkv_proj" not in n]
    llm.load_weights(q + others)
    assert _tokens(llm) == reference


@pytest.fixture(scope="module")
def fused_llm(dirs):
    return LLM(str(dirs[0]), model_impl="transformers", dtype="float32", block_size=4)


def _bad(fused_llm, pairs, *needles):
    before = _snapshot(fused_llm)
    with pytest.raises(ValueError) as e:
        fused_llm.load_weights(pairs)
    for needle in needles:
        assert needle in str(e.value)
    after = _snapshot(fused_llm)
    assert all(torch.equal(after[n][1], before[n][1]) for n in before), "a bad update changed weights"


def test_wrong_shape_names_tensor_and_both_shapes(fused_llm, dirs):
    pairs = list(_hf(dirs[1], True).named_parameters())
    name = "model.layers.1.self_attn.qkv_proj.weight"
    i = next(i for i, (n, _) in enumerate(pairs) if n == name)
    good = pairs[i][1]
    pairs[i] = (name, good[:-1])
    _bad(fused_llm, pairs, name, str(tuple(good[:-1].shape)), str(tuple(good.shape)))


def test_missing_and_extra_tensors_are_named(fused_llm, dirs):
    pairs = [(n, t) for n, t in _hf(dirs[1], False).named_parameters() if n != "model.layers.0.self_attn.k_proj.weight"]
    _bad(fused_llm, pairs, "hf_model.model.layers.0.self_attn.qkv_proj.weight", "'k'")
    extra = [*_hf(dirs[1], True).named_parameters(), ("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))]
    _bad(fused_llm, extra, "model.layers.9.mlp.up_proj.weight", "(2, 2)", "matches no parameter")
    # a name twice: the last copy won silently (a fresh user's zeroed embedding)
    pairs = list(_hf(dirs[1], True).named_parameters())
    twice = pairs + [(pairs[0][0], torch.zeros_like(pairs[0][1]))]
    _bad(fused_llm, twice, f"tensor {pairs[0][0]!r} is given twice")


def test_partial_update_with_strict_false_and_type_errors(fused_llm, dirs):
    norm = "model.norm.weight"
    new = torch.full_like(dict(_hf(dirs[1], False).named_parameters())[norm], 0.5)
    assert fused_llm.load_weights([(norm, new)], strict=False) == {"hf_model." + norm}
    assert torch.equal(fused_llm.llm_engine.model_runner.model.hf_model.model.norm.weight, new)
    with pytest.raises(TypeError, match="pair"):
        fused_llm.load_weights([("x", 1.0)])
    with pytest.raises(TypeError, match="iterable"):
        fused_llm.load_weights(3)


def test_strict_false_skips_extra_tensors_but_not_a_wrong_shape(fused_llm, dirs, caplog):
    """fresh-8 F15: strict=False is torch's load_state_dict(strict=False) (extras skipped and logged)."""
    norm = "model.norm.weight"
    new = torch.full_like(dict(_hf(dirs[1], False).named_parameters())[norm], 0.25)
    extra = ("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.worker.weight_sync"):
        assert fused_llm.load_weights([(norm, new), extra], strict=False) == {"hf_model." + norm}
    assert torch.equal(fused_llm.llm_engine.model_runner.model.hf_model.model.norm.weight, new)
    assert "model.layers.9.mlp.up_proj.weight" in caplog.text and "skipped 1 tensor" in caplog.text
    before = _snapshot(fused_llm)
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        fused_llm.load_weights([(norm, torch.zeros(3)), extra, ("model.layers.0.input_layernorm.weight",
                                                                 torch.zeros_like(new))], strict=False)
    after = _snapshot(fused_llm)
    assert all(torch.equal(after[n][1], before[n][1]) for n in before), "a refused update changed weights"


def test_a_tied_engine_refuses_differing_embedding_and_head(fused_llm, dirs):
    """The engine ties lm_head to embed_tokens: both sent with different values (a trainer's untied head, PEFT's
    modules_to_save=["lm_head"]) is an error before any copy (the last copy won silently: a fresh user's find);
    equal values, as a tied model's state_dict holds them, are taken."""
    assert fused_llm.llm_engine.model_config.hf_config.tie_word_embeddings
    state = dict(_hf(dirs[1], False).state_dict())
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    fused_llm.load_weights(state)  # equal: fine
    state["lm_head.weight"] = state["lm_head.weight"] + 0.5
    _bad(fused_llm, state, "two tensors with different values", "tied parameter", "tie_word_embeddings=false")


def test_a_tied_state_dict_holding_a_nan_is_copied_as_it_is(fused_llm, dirs):
    """A diverged tied trainer's state_dict (head and embedding one tensor, a NaN in it) was refused as "two tensors
    with different values" (NaN != NaN), naming an untied head it does not have; a NaN is copied as it is."""
    model = _hf(dirs[1], False)
    with torch.no_grad():
        model.model.embed_tokens.weight[5, 3] = float("nan")
    fused_llm.load_weights(model.state_dict())
    weight = dict(fused_llm.llm_engine.model_runner.model.named_parameters())["hf_model.model.embed_tokens.weight"]
    assert weight[5, 3].isnan() and weight.isnan().sum() == 1
    fused_llm.load_weights(_hf(dirs[0], False))  # finite again: the tests after compare snapshots with torch.equal


def test_a_meta_parameter_of_a_model_is_refused_before_any_copy(fused_llm, dirs):
    """A model source with a parameter on the meta device: TypeError before anything is copied (the q/k/v and
    gate/up copies had run before torch's NotImplementedError; a fresh user's find)."""
    model = _hf(dirs[1], False)
    model.model.norm.weight = torch.nn.Parameter(torch.empty(model.model.norm.weight.shape, device="meta"))
    before = _snapshot(fused_llm)
    with pytest.raises(TypeError, match=r"tensor 'model.norm.weight' is on the meta device"):
        fused_llm.load_weights(model)
    after = _snapshot(fused_llm)
    assert all(torch.equal(after[n][1], before[n][1]) for n in before), "a refused update changed weights"


def test_load_weights_waits_for_a_generate_in_another_thread(fused_llm, dirs):
    """LLM.load_weights / sleep / wake_up take the lock generate holds, so a sync from another thread never lands
    between two steps of a running generate (a fresh user saw mixed-weight outputs)."""
    import threading

    model, done = _hf(dirs[1], True), threading.Event()
    with fused_llm._engine_lock:  # as a generate in another thread holds it
        thread = threading.Thread(target=lambda: (fused_llm.load_weights(model), done.set()))
        thread.start()
        assert not done.wait(0.5), "load_weights ran while generate held the engine"
    thread.join(30)
    assert done.is_set()


def test_busy_engine_refuses_sync(fused_llm, dirs):
    fused_llm.llm_engine.add_request("busy", "Hello", GREEDY)
    try:
        with pytest.raises(RuntimeError, match="idle"):
            fused_llm.load_weights(_hf(dirs[1], True))
    finally:
        fused_llm.llm_engine.abort_request("busy")


@pytest.mark.parametrize("optimized", [False, True], ids=["peft", "peft-optimized"])
def test_peft_lora_model_syncs_merged_and_stays_unmerged(dirs, optimized):
    """A PEFT LoRA model (q_proj / v_proj adapters, the final norm kept by modules_to_save), optimized or not, syncs
    as TRL syncs one into vLLM: the adapters merged into the base weights for the copy, in the base checkpoint's
    names; the engine then decodes as the merged model does, and the trainer's model is left unmerged (to peft's
    rounding: merge adds B A to the weight, unmerge subtracts it, as in TRL's sync)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["model.norm"])
    model = peft.get_peft_model(_hf(dirs[1], False), config)
    for name, param in model.named_parameters():
        if "lora_B" in name or "modules_to_save" in name:
            param.data.add_(torch.randn_like(param) * 0.05)  # adapters that change the output
    if optimized:
        model = fxrewrite.optimize(model)
    base = {n: p.detach().clone() for n, p in model.get_base_model().named_parameters() if "lora_" not in n}
    llm = LLM(str(dirs[0]), model_impl="transformers", dtype="float32", block_size=4)
    llm.load_weights(model)
    for n, p in model.get_base_model().named_parameters():  # unmerged again (peft's subtraction rounds)
        if "lora_" not in n:
            torch.testing.assert_close(p.detach(), base[n], rtol=0, atol=1e-6, msg=n)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    with torch.no_grad():
        ids = torch.tensor([llm.get_tokenizer()(PROMPTS[0])["input_ids"]])
        want = []
        for _ in range(GREEDY.max_tokens):
            want.append(int(model(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
    got = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == want
    assert list(got) != list(_tokens(LLM(str(dirs[1]), model_impl="native", dtype="float32", block_size=4))[0])


@pytest.mark.parametrize("kind", ["dora", "ia3", "disabled"])
def test_peft_adapters_that_replace_weights_or_are_disabled_sync_what_the_model_computes(dirs, kind):
    """DoRA and IA3 merge by replacing a weight's tensor (LoRA adds in place): the pairs are read after the merge.
    Inside disable_adapter() the model computes the base weights: nothing is merged. Either way the engine's
    greedy tokens equal the PEFT model's own."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = (peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
              if kind == "ia3" else peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=kind == "dora"))
    model = peft.get_peft_model(_hf(dirs[1], False), config)
    for name, param in model.named_parameters():
        if "lora_B" in name or "ia3_l" in name or "lora_magnitude" in name:
            param.data.add_(torch.randn_like(param) * 0.3)
    llm = LLM(str(dirs[0]), model_impl="native", dtype="float32", block_size=4)

    def model_tokens():
        with torch.no_grad():
            ids = torch.tensor([llm.get_tokenizer()(PROMPTS[0])["input_ids"]])
            for _ in range(GREEDY.max_tokens):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        return ids[0, -GREEDY.max_tokens:].tolist()
    if kind == "disabled":
        with model.disable_adapter():
            llm.load_weights(model)
            want = model_tokens()
        assert want == list(_tokens(LLM(str(dirs[1]), model_impl="native", dtype="float32", block_size=4))[0])
    else:
        llm.load_weights(model)
        want = model_tokens()
    assert list(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == want


def test_peft_prompt_learning_is_refused(dirs):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_hf(dirs[1], False), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                             num_virtual_tokens=2))
    llm = LLM(str(dirs[0]), model_impl="native", dtype="float32", block_size=4)
    with pytest.raises(TypeError, match="cannot be merged"):
        llm.load_weights(model)
    tokens = peft.get_peft_model(_hf(dirs[1], False), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                      trainable_token_indices=[3, 5]))
    with pytest.raises(TypeError, match="TrainableTokensWrapper.*merge_and_unload"):
        llm.load_weights(tokens)
    assert not any(getattr(m, "merged", False) for m in tokens.modules())
