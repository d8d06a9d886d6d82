"""The oracle: which (prepare/finalize, experts) pair serves each token bucket, and why.

    >>> from moe import MoEProblem, Platform
    >>> p = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    >>> plan(p, Platform.preset("cpu"), Policy()).bucket_for(1).chosen.pair.experts
    'torch_grouped'

``plan`` checks every registered candidate (keeping all reasons), ranks the survivors per token bucket
by a roofline cost model scaled by efficiency profiles (``moe/oracle/profiles/*.yaml``, replaced by
measured ones where present), applies the policy, and returns a ``Plan`` that explains itself.
"""

from moe.oracle.policy import Policy
from moe.oracle.profile import ProfileEntry, ProfileShape, load_profile, save_profile
from moe.oracle.select import Bucket, Candidate, Pair, Plan, Scored, plan

__all__ = [
    "Bucket",
    "Candidate",
    "Pair",
    "Plan",
    "Policy",
    "ProfileEntry",
    "ProfileShape",
    "Scored",
    "load_profile",
    "plan",
    "save_profile",
]
