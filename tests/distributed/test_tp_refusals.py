"""Models that cannot run at tensor_parallel_size=2 are refused as at TP=1: one UserInputError naming the model and
the reason, reported by the workers to the driver (the CLI prints one line), not a rank's traceback or a false
"checkpoint is missing" (BERT's decoder bias is tied to `cls.predictions.bias`; sharding the LM head lost the tie)."""

import json
import shutil

import pytest

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.llm import LLM


@pytest.fixture(scope="module")
def bert_dirs(tiny_model_dir, tmp_path_factory):
    encoder = tiny_model_dir("bert", vocab="smollm2")
    decoder = tmp_path_factory.mktemp("bert-decoder") / "bert"
    shutil.copytree(encoder, decoder)
    config = json.loads((decoder / "config.json").read_text())
    (decoder / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    return encoder, decoder


@pytest.mark.parametrize("which, kwargs, match", [
    # the tied LM-head bias loads into the shard; then the load check refuses bidirectional attention, as at TP=1
    ("encoder", {}, r"BertLMHeadModel: BertSelfAttention calls attention with is_causal=False"),
    # fused: the linear BERT's attention output reaches (attention.output.dense) is in a sibling module, not a child
    ("decoder", {}, r"cannot shard bert\.encoder\.layer\.0\.attention\.self\.qkv_proj: among the children of "
                    r"BertSelfAttention its outputs reach no proven row partner \(the outputs reach 0 linears"),
    # unfused: transformers has no tensor-parallel plan for BERT, so every rank attends with all heads
    ("decoder", {"fusion": False}, r"layer 0 attends with all 4 key/value heads on each of the 2 tensor-parallel"),
])
def test_bert_at_tp2_is_refused_with_its_reason(bert_dirs, which, kwargs, match):
    path = bert_dirs[0] if which == "encoder" else bert_dirs[1]
    with pytest.raises(UserInputError, match=match):
        LLM(str(path), model_impl="transformers", tensor_parallel_size=2, **kwargs)
