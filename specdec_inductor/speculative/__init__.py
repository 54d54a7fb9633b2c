"""Speculative decoding: the step loop shared by every method (loop.py), plain greedy decoding
as that loop without a proposer (plain.py, behind Engine.generate), its draft-budget policies
(policies.py), the tensor commit of a verified step and the step as one program, greedy or
sampled (commit.py), draft trees (tree.py), the proposer interface (proposer.py) and metrics
(stats.py)."""
from specdec_inductor.speculative.loop import ActiveRequest, Batch, SpeculativeGenerator
from specdec_inductor.speculative.policies import (AcceptanceGate, AdaptiveVerifySize,
                                                   DraftPolicy, StepCosts, StepPlan)
from specdec_inductor.speculative.proposer import Proposer
from specdec_inductor.speculative.stats import SpeculativeStats, step_times
from specdec_inductor.speculative.tree import (DraftProgram, DraftTree, VerifyInputs,
                                               root_only_draft, star_tree)

__all__ = ["AcceptanceGate", "ActiveRequest", "AdaptiveVerifySize", "Batch", "DraftPolicy",
           "DraftProgram", "DraftTree", "Proposer", "SpeculativeGenerator", "SpeculativeStats",
           "StepCosts", "StepPlan", "VerifyInputs", "root_only_draft", "star_tree", "step_times"]
