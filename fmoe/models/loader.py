def load_moe_block(*a, **k): raise NotImplementedError
