"""The names the model's arrays are split by: the two mesh axes, and the logical axis each
parameter dimension declares where it is defined (`axes=` on its `nnx.Param`).

They live with the model because the model names its own dimensions; which mesh axes a logical
name splits over is decided in one table elsewhere (`dsv4_jax.parallel.sharding.mesh_axis_rules`).
"""

# ---- mesh axes -------------------------------------------------------------------------------
DATA, TENSOR = "data", "tensor"
MESH_AXES = (DATA, TENSOR)

# ---- logical axes (the names parameters declare) ---------------------------------------------
LAYERS = "layers"  # the repetition axis of stacked layers
EMBED = "embed"  # hidden size
VOCAB = "vocab"  # vocabulary rows of the embedding and the head
NORM = "norm"  # an RMSNorm weight, whatever it normalises
Q_LORA = "q_lora"  # the query latent
HEADS = "heads"  # query heads (the attention sinks)
HEAD_DIMS = "head_dims"  # query heads x head_dim, flattened (wq_b's rows, wo_a's columns)
KV_DIM = "kv_dim"  # the single shared K=V head
O_GROUP_RANKS = "o_group_ranks"  # o_groups x o_lora_rank, flattened (wo_a's rows, wo_b's columns)
GROUP_HEAD_DIMS = "group_head_dims"  # one output group's heads x head_dim (wo_a's columns)
COMPRESS = "compress"  # compressor projections and positional biases
INDEXER = "indexer"  # lightning indexer heads and dims
ROUTER = "router"  # gate rows (one per routed expert), its bias and the hash table
HASH_VOCAB = "hash_vocab"  # tid2eid rows: small int32, replicated
EXPERTS = "experts"  # routed experts
MOE_FFN = "moe_ffn"  # a routed expert's intermediate dimension
SHARED_FFN = "shared_ffn"  # the shared expert's intermediate dimension
HC = "hc"  # mHC mixing parameters
