class FmoeMoEBlock: pass
def patch(m): raise NotImplementedError
