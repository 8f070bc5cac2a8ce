"""A strategy added through the registry alone (ZEROLENS_PLUGINS=zerolens_test_strategy): torch DDP
under another name, with DDP's layout."""
from zerolens.strategies.registry import DDP, DDP_CODE, StrategySpec, register, spec

ddp = spec("ddp")
register(StrategySpec(name="ddp-again", backend=DDP, needs_deepspeed=False, paper_stage=0, shards_gradients=False,
                      description="torch DDP under another name (tests)", layout=ddp.layout, unpadded=ddp.unpadded,
                      transient_code=DDP_CODE, step_model=ddp.step_model))
