# The kernels' shared types and constants, defined once (every kernel module cimports them).
from libc.stdint cimport int32_t

# The one token type: llama.cpp's llama_token. tests/test_engine.py pins it to numpy.int32.
# Valid ids are 0 .. TOKEN_MAX_C: negative ids are refused at the boundary (`_proposer`), so a
# kernel may use a negative value as a sentinel. Token positions are kept in 32 bits (as
# llama.cpp's llama_pos), so no context is longer than TOKEN_MAX_C tokens either.
ctypedef int32_t token_t

cdef enum:
    TOKEN_MAX_C = 2147483647
    # Kernels whose work exceeds this many tokens release the GIL (below it the release costs
    # more than it buys). The one GIL threshold of every kernel module that reads tokens.
    NOGIL_MIN_TOKENS = 4096
    # ngram-cache frees a context cache of at least this many n-grams without the GIL (about
    # 0.1 ms and more): the one threshold counted in n-grams rather than tokens.
    NOGIL_FREE_NGRAMS = 4096
    # ngram-mod's pool (common_ngram_mod): 2**22 int32 entries, EMPTY = -1.
    MOD_POOL_SIZE = 4194304
    MOD_POOL_MASK = 4194303
    MOD_EMPTY = -1
