"""The trust tier: mechanism behind one call each (DeepSpeed engines and checkpoints, datasets, the Ray cluster,
vLLM engines, weight sync, logging, the exit path). A forker reads each call's signature and docstring and
trusts the body; the algorithms' math lives in the scripts and in common/'s read tier."""
