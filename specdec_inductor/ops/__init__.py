"""Python side of the `torch.ops.specdec` ops: one wrapper with a docstring and one fake kernel
per op (schemas and CPU kernels live in csrc/, references in reference.py)."""
from specdec_inductor.ops.tree import (  # noqa: F401
    TreeMaskMode,
    build_tree,
    reconstruct_tree_from_mask,
    verify_tree_greedy,
    verify_tree_greedy_out,
)
from specdec_inductor.ops.kv_slots import (  # noqa: F401
    assign_draft_cache_locs,
    assign_req_to_token,
    build_draft_decode_table,
    compact_accepted_cache_locs,
    fill_bonus_tokens,
    gather_extend_cache_locs,
    move_kv_slots,
)
from specdec_inductor.ops.attention import (  # noqa: F401
    decode_attention,
    extend_attention,
    store_kv,
)
from specdec_inductor.ops.sampling import (  # noqa: F401
    chain_speculative_sampling,
    top_k_top_p_renorm,
    tree_speculative_sampling,
)
from specdec_inductor.ops.linear import (  # noqa: F401
    clear_packed_weights, packed_weight_stats, register_packed_weight, release_packed_weight,
    skinny_linear, skinny_linear_cat)
from specdec_inductor.ops.quant import (  # noqa: F401
    QuantActivation, QuantFormat, int8_path, quant_block, quant_dequantize,
    quant_embedding, quant_linear, quant_row_bytes)
