"""Optional kernel backends: FlexAttention from a pattern (:mod:`.flex`, chosen by :mod:`zoo.plug.backend`) and
flash-linear-attention's triton kernels (:mod:`.fla`, asked first by the delta rule, gated linear attention and
NSA's selected branch). Imported by module, never from here: each pulls in what it needs only when used."""
