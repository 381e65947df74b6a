"""A model folder with its own modeling code (`auto_map`, as hub repositories that need trust_remote_code ship):
LLM(..., trust_remote_code=True) builds that code, as transformers and vLLM do (the flag reached the config and the
tokenizer but not the model: transformers asked "[y/N]" on stdin and the load died; a fresh user found it)."""

import json

import torch
from transformers import AutoModelForCausalLM

from fxrewrite import LLM, SamplingParams
from fxrewrite.runtime.model_files.demo import build_model_dir

MODELING = '''
from transformers import LlamaConfig, LlamaForCausalLM


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote_llama"


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
'''


def test_remote_code_model_builds_with_trust_remote_code(tmp_path):
    folder = build_model_dir(tmp_path / "remote", "llama", vocab="smollm2")
    (folder / "modeling_remote.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote_llama", architectures=["RemoteLlamaForCausalLM"],
                  auto_map={"AutoConfig": "modeling_remote.RemoteLlamaConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    prompt = [5, 6, 7, 8]
    # the engine first: transformers' own from_pretrained registers the folder's classes, after which any load finds them
    llm = LLM(str(folder), trust_remote_code=True, model_impl="transformers", dtype="float32", max_model_len=64)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(hf).__name__ == "RemoteLlamaForCausalLM"
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert got[0].outputs[0].token_ids == want
