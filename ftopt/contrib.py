"""optax's ``optax.contrib`` namespace: the same transforms as ``ftopt``'s top level,
gathered under the names optax's users import them by (``ftopt.contrib.muon``,
``from ftopt.contrib import schedule_free_adamw``)."""

from __future__ import annotations

from ftopt.alias import ademamix
from ftopt.alias_matrix import muon, normuon, soap
from ftopt.alias_more import cocob, dog, dowg, madgrad, mars
from ftopt.alias_prodigy import dadapt_adamw, prodigy
from ftopt.alias_variants import acprop, adopt, ano, simplified_ademamix
from ftopt.base import EmptyState
from ftopt.cautious import CautiousState, cautious
from ftopt.complex_valued import SplitRealAndImaginaryState, split_real_and_imaginary
from ftopt.galore import GaLoreDimensionNumbers, GaLoreState, galore, scale_by_galore
from ftopt.matrix_views import MuonDimensionNumbers
from ftopt.mechanic import MechanicState, mechanize
from ftopt.momo import MomoAdamState, MomoState, momo, momo_adam
from ftopt.plateau import ReduceLROnPlateauState, reduce_on_plateau
from ftopt.privacy import (
    DifferentiallyPrivateAggregateState,
    differentially_private_aggregate,
    dpsgd,
)
from ftopt.sam import SAMState, sam
from ftopt.schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from ftopt.sophia import HutchinsonState, SophiaState, hutchinson_estimator_diag_hessian, sophia
from ftopt.transforms.adam_family import scale_by_acprop
from ftopt.transforms.adam_rectified import scale_by_adopt
from ftopt.transforms.adaptive import (
    ScaleByAdemamixState,
    ScaleBySimplifiedAdEMAMixState,
    scale_by_ademamix,
    scale_by_simplified_ademamix,
)
from ftopt.transforms.clipping import normalize
from ftopt.transforms.cocob import COCOBState, scale_by_cocob
from ftopt.transforms.dadapt import DAdaptAdamWState
from ftopt.transforms.dog import DoGState, DoWGState
from ftopt.transforms.madgrad import MadgradState, scale_by_madgrad
from ftopt.transforms.mars import scale_by_mars
from ftopt.transforms.muon import scale_by_muon
from ftopt.transforms.normuon import NorMuonState, scale_by_normuon
from ftopt.transforms.prodigy import ProdigyState
from ftopt.transforms.scaling import add_cautious_weight_decay
from ftopt.transforms.sign import scale_by_ano
from ftopt.transforms.soap import scale_by_soap

NormalizeState = EmptyState

__all__ = [
    "acprop", "add_cautious_weight_decay", "ademamix", "adopt", "ano", "cautious",
    "CautiousState", "cocob", "COCOBState", "dadapt_adamw", "DAdaptAdamWState",
    "differentially_private_aggregate", "DifferentiallyPrivateAggregateState", "dog",
    "DoGState", "dowg", "DoWGState", "dpsgd", "galore", "GaLoreDimensionNumbers",
    "GaLoreState", "hutchinson_estimator_diag_hessian", "HutchinsonState", "madgrad",
    "MadgradState", "mars", "MechanicState", "mechanize", "momo", "momo_adam",
    "MomoAdamState", "MomoState", "muon", "MuonDimensionNumbers", "normalize",
    "NormalizeState", "normuon", "NorMuonState", "prodigy", "ProdigyState",
    "reduce_on_plateau", "ReduceLROnPlateauState", "sam", "SAMState", "scale_by_acprop",
    "scale_by_ademamix", "scale_by_adopt", "scale_by_ano", "scale_by_cocob",
    "scale_by_galore", "scale_by_madgrad", "scale_by_mars", "scale_by_muon",
    "scale_by_normuon", "scale_by_simplified_ademamix", "scale_by_soap",
    "ScaleByAdemamixState", "ScaleBySimplifiedAdEMAMixState", "schedule_free",
    "schedule_free_adamw", "schedule_free_eval_params", "schedule_free_sgd",
    "ScheduleFreeState", "simplified_ademamix", "soap", "sophia", "SophiaState",
    "split_real_and_imaginary", "SplitRealAndImaginaryState",
]
