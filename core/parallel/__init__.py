"""dspzoo.core.parallel: the DSP layer — everything that decides and moves shards.

=================  ============================================================================
``mesh``           dp × sp process groups, each its own communicator
``comm``           autograd collectives (uneven sizes; failures reach every rank)
``layout``         named sequence dims, balanced unpadded shards (``SeqSpec``)
``planner``        the one planner: sharded dim and method per activation and stage
``plan``           single-activation stages and plans (the one-activation case)
``multiplan``      several activations (the Evoformer's MSA and pair) and running their plans
``runtime``        ``SeqParallel``: enter, switch, stages, attention, exit
``context``        the runtime a block reads while a sharded region is active
``methods``        the method registry and kernels (ulysses, ring, lss, usp, megatron_sp, …)
``strategies``     planning policies over the methods (dsp, the fixed-dim ones, auto)
``rng``, ``sharded_rng``  keyed randomness, exact under any sharding
``trace``          bytes per collective, op and region; saved-tensor memory
``validate``       input checks that raise on every rank of the group
=================  ============================================================================

Nothing here imports the cost model, the training harness, the zoo or a domain.
"""
