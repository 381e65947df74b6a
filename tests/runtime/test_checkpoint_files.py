"""Which weight files a model folder loads (transformers' rules), and checkpoints missing one part of a fused weight."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxrewrite.errors import UserFileNotFoundError, UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.fp8_checkpoint import is_quantized_name, write_fp8_checkpoint
from fxrewrite.runtime.model_files.loader import checkpoint_files, iterate_safetensors

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _tensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _copy_without_weights(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    return dst


def _sharded(src, dst, extra: dict[str, torch.Tensor] | None = None):
    """`src`'s weights in two shards with an index, plus `extra` in a `consolidated.safetensors` the index does
    not name (Mistral folders ship both layouts)."""
    tensors = _tensors(src)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / file))
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if extra is not None:
        save_file(extra, str(dst / "consolidated.safetensors"))
    return dst


def _greedy(path, impl):
    llm = LLM(str(path), model_impl=impl, dtype="float32", block_size=4)
    return llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_an_index_decides_the_files_and_a_stray_consolidated_file_is_not_read(tiny_qwen3_dir, tmp_path, impl):
    """fresh-user report: every *.safetensors was read, so a Mistral-style folder with consolidated.safetensors
    beside its shards failed on names the model does not have (native) or loaded them twice."""
    folder = _sharded(tiny_qwen3_dir, _copy_without_weights(tiny_qwen3_dir, tmp_path / "m"),
                      extra={"layers.0.attention.wq.weight": torch.zeros(2, 2)})
    assert [f.name for f in checkpoint_files(folder)] == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    assert {n for n, _ in iterate_safetensors(folder)} == set(_tensors(tiny_qwen3_dir))
    assert _greedy(folder, impl) == _greedy(tiny_qwen3_dir, impl)


def test_model_safetensors_wins_over_stale_shards(tiny_qwen3_dir, tmp_path):
    folder = _copy_without_weights(tiny_qwen3_dir, tmp_path / "m")
    save_file({n: t.contiguous() for n, t in _tensors(tiny_qwen3_dir).items()}, str(folder / "model.safetensors"))
    save_file({"stale": torch.zeros(1)}, str(folder / "model-00001-of-00002.safetensors"))
    assert checkpoint_files(folder) == [folder / "model.safetensors"]


def test_an_index_naming_an_absent_file_or_without_weight_map_is_one_clear_error(tiny_qwen3_dir, tmp_path):
    folder = _sharded(tiny_qwen3_dir, _copy_without_weights(tiny_qwen3_dir, tmp_path / "m"))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserFileNotFoundError, match=r"names weight files that are not in .*model-00002-of-00002"):
        checkpoint_files(folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(UserInputError, match="is not a safetensors index .*weight_map"):
        checkpoint_files(folder)


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_a_checkpoint_missing_one_part_of_a_fused_weight_is_refused(tiny_qwen3_dir, tmp_path, impl, dropped):
    """fresh-user report: without k_proj (or up_proj) the fused qkv_proj (gate_up_proj) counted as loaded and a
    slice of it kept uninitialised memory; the error names the checkpoint tensor that is missing."""
    folder = _copy_without_weights(tiny_qwen3_dir, tmp_path / "m")
    tensors = _tensors(tiny_qwen3_dir)
    del tensors[dropped]
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    with pytest.raises(UserInputError, match=rf"the checkpoint in {folder} is missing 1 parameter\(s\): {dropped}$"):
        LLM(str(folder), model_impl=impl, dtype="float32", block_size=4)  # checkpoint names: no hf_model. prefix


def test_fp8_checkpoint_refuses_a_file_as_destination_and_quantizes_mixtral_experts(tiny_qwen3_dir, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    with pytest.raises(UserInputError, match="DST .*a-file.* exists and is not a folder"):
        write_fp8_checkpoint(tiny_qwen3_dir, target)
    w = torch.zeros(4, 4)
    assert is_quantized_name("model.layers.0.block_sparse_moe.experts.3.w2.weight", w)
    assert not is_quantized_name("model.layers.0.block_sparse_moe.gate.weight", w)
    assert not is_quantized_name("model.layers.0.input_layernorm.weight", torch.zeros(4))


@pytest.mark.parametrize("arch", ["gpt_neox", "starcoder2", "qwen2_moe", "deepseek_v3"])
def test_fp8_checkpoint_quantizes_what_the_loader_expects(tiny_model_dir, tmp_path, arch):
    """fresh-user report: the tool quantized `*proj.weight` names only, so GPT-NeoX's query_key_value, Starcoder2's
    c_fc, Qwen2-MoE's shared_expert_gate and DeepSeek-V3's kv_a_proj_with_mqa stayed float and the engine refused
    the folder (missing *_scale_inv). Now every linear layer of the model transformers builds (but the head and the
    routers) is FP8, the folder loads, and its greedy tokens are the model's own on the dequantized weights."""
    from safetensors import safe_open

    from fxrewrite.layers.fp8_linear import dequantize_weight_fp8

    src = tiny_model_dir(arch)
    dst = write_fp8_checkpoint(src, tmp_path / "fp8")
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    quantized = {n[: -len("_scale_inv")] for n in tensors if n.endswith("_scale_inv")}
    assert quantized and all(tensors[n].dtype == torch.float8_e4m3fn for n in quantized)
    assert not any("lm_head" in n or "embed" in n or n.endswith(".gate.weight") for n in quantized), quantized
    dequantized = _copy_without_weights(src, tmp_path / "dequantized")  # the same values in float32
    save_file({n: (dequantize_weight_fp8(t, tensors[n + "_scale_inv"], (128, 128)) if n in quantized else t)
               for n, t in tensors.items() if not n.endswith("_scale_inv")}, str(dequantized / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got, want = ([o.outputs[0].token_ids for o in LLM(str(folder), model_impl="transformers", dtype="float32",
                                                      block_size=4).generate([[5, 6, 7, 8]], params, use_tqdm=False)]
                 for folder in (dst, dequantized))
    assert got == want


def _with_tensors(src, dst, change) -> "Path":
    folder = _copy_without_weights(src, dst)
    tensors = _tensors(src)
    change(tensors)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.input_layernorm.weight"])
def test_a_tensor_of_the_wrong_shape_is_one_error_naming_it(tiny_qwen3_dir, tmp_path, impl, name):
    """fresh-user report: a k_proj one row too long loaded its first rows silently (the fused loader narrowed it
    without checking its full size); a wrong norm was a ValueError traceback that named no tensor."""
    shape = tuple(_tensors(tiny_qwen3_dir)[name].shape)
    grown = (shape[0] + 1, *shape[1:])

    def grow(tensors):
        tensors[name] = torch.randn(grown)

    folder = _with_tensors(tiny_qwen3_dir, tmp_path / "m", grow)
    with pytest.raises(UserInputError) as err:
        LLM(str(folder), model_impl=impl, dtype="float32", block_size=4)
    assert f"the checkpoint in {folder}: checkpoint tensor '{name}' does not fit the model: " in str(err.value)
    if impl == "native":  # both shapes, one phrase for every native loader (transformers words its own)
        assert f"weight shape {grown} does not match {shape}" in str(err.value)


def test_an_extra_tensor_is_refused_by_native_and_skipped_with_a_warning_by_transformers(tiny_qwen3_dir, tmp_path,
                                                                                       caplog):
    """transformers' rule (warn, load the rest) for its own model; a native model built for another config
    (a bias it lacks) would compute something else, so it refuses."""
    extra = "model.layers.0.self_attn.q_proj.bias"
    folder = _with_tensors(tiny_qwen3_dir, tmp_path / "m", lambda t: t.update({extra: torch.zeros(128)}))
    with pytest.raises(UserInputError, match=rf"checkpoint tensor '{extra}' has no parameter in the native "
                                             "Qwen3ForCausalLM"):
        LLM(str(folder), model_impl="native", dtype="float32", block_size=4)
    with caplog.at_level("WARNING"):
        assert _greedy(folder, "transformers") == _greedy(tiny_qwen3_dir, "transformers")
    assert f"1 tensor(s) of the checkpoint in {folder} are not used by the model: {extra}" in caplog.text
