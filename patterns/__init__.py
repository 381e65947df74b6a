"""Fusion patterns, one file each; `PATTERNS` is the order the compiler tries them in.

Order (documented, and harmless by construction: patterns claim disjoint fx nodes, which the
compiler checks):
1. `RMSNormPattern`, `RotaryPattern` (scope "module"): replace whole leaf modules first, so that
   parents see the fused layers when they are matched (the residual variant needs them).
2. `QKVPattern` (three linears), `GLUPattern` (two linears and a product): disjoint by the number
   of linears sharing an input.
3. `QKNormRopePattern`, `RotaryApplyPattern`: the rotary call in attention, after QKV (independent
   edits of one forward); a call whose q and k are per-head RMSNorms (Qwen3) is the first's, every
   other one the second's (`RotaryApplyPattern` leaves the first's calls alone).
4. `ResidualRMSNormPattern`: the add + norm in a decoder layer; `InputNormPattern`: the layer's input norm into its
   attention's qkv_proj (after QKV, whose proof it reads from the attention instance).
5. `MoEPattern` (scope "module"): a sparse MoE block (router, experts, shared expert) -> `FusedMoE`;
   its children (the shared expert's gated MLP) are fused first, as classes go children first.
6. `LMHeadLossPattern`: the LM head + loss of a causal LM (fused linear cross-entropy while training).
A new pattern is one file plus one line here.
"""

from fxrewrite.patterns.base import Context, Match, Pattern, Refusal
from fxrewrite.patterns.glu import GLUPattern
from fxrewrite.patterns.input_norm import InputNormPattern
from fxrewrite.patterns.lm_head_loss import LMHeadLossPattern
from fxrewrite.patterns.moe import MoEPattern
from fxrewrite.patterns.qk_norm_rope import QKNormRopePattern
from fxrewrite.patterns.qkv import QKVPattern
from fxrewrite.patterns.rms_norm import ResidualRMSNormPattern, RMSNormPattern
from fxrewrite.patterns.rotary import RotaryApplyPattern, RotaryPattern

PATTERNS: tuple[type[Pattern], ...] = (
    RMSNormPattern,
    RotaryPattern,
    QKVPattern,
    GLUPattern,
    QKNormRopePattern,
    RotaryApplyPattern,
    ResidualRMSNormPattern,
    InputNormPattern,
    MoEPattern,
    LMHeadLossPattern,
)

__all__ = ["PATTERNS", "Context", "Match", "Pattern", "Refusal"]
