"""Every chunk and size limit of the shared kernels, named once by what it bounds.

Kernels read these at call time (``limits.NAME``), so a test may shrink one with ``monkeypatch.setattr`` on this
module and every reader follows. The limits bound working memory only: results never depend on them, except where a
docstring says a chunk also fixes the dropout masks (those are a function of the shapes and these values).
"""

# Selection scores per chunk of queries: MoBA's block gates, NSA's compressed scores, DSA's indexer (4 MB in fp32).
SCORE_CHUNK_ELEMENTS = 2**20

# Gathered key elements per chunk of the CPU gathered kernels and of decoding gathers (4 MB in fp32).
GATHER_CHUNK_ELEMENTS = 2**20

# Off the CPU flash path: gathered key elements per chunk (256 MB in fp32).
DEVICE_CHUNK_ELEMENTS = 2**26

# Off the CPU flash path: entries per SDPA call, under the 65,535 of a CUDA grid axis.
DEVICE_CHUNK_ENTRIES = 2**15

# Query elements per batch of key-block groups (MoBA's and NSA's chosen blocks on the CPU; 16 MB in fp32).
KEY_BLOCK_BATCH_ELEMENTS = 2**22

# Key elements of the runs one band (sliding-window) flash call reads (8 MB in fp32).
RUN_CHUNK_ELEMENTS = 2**21

# Scores per chunk of the dropout kernels (4 MB in fp32); the chunks, hence the masks, depend on it.
DROPOUT_CHUNK_ELEMENTS = 2**20

# A chunk of one group's rows over many keys (global rows) holds this many times DROPOUT_CHUNK_ELEMENTS scores.
DROPOUT_ROW_CHUNK_FACTOR = 2

# DSA's gathered key elements per chunk of queries, forward and backward (4 MB in fp32).
DSA_GATHER_CHUNK_ELEMENTS = 2**20

# Elements per tensor and head group in :func:`zoo.ops.in_head_groups` (8 MB in fp32).
HEAD_GROUP_ELEMENTS = 2**21

# Queries per flash call of NSA's compressed branch: each call reads the blocks up to its last visible one.
NSA_COMPRESSED_QUERY_CHUNK = 256

# Query block of NSA's window on the CPU flash path: each block reads a run of about window + 128 keys.
NSA_WINDOW_QUERY_BLOCK = 128

# (query, key) pairs per chunk while FlexAttention's backend evaluates a pattern into tile counts.
FLEX_EVAL_CHUNK_ELEMENTS = 1 << 24
