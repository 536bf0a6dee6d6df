"""ftopt's aliases and bitsandbytes-table chains against the float64 references of reference.py.

* fp32 params: >= 20 steps, fresh seeded random grads each step (10% exact zeros), through
  ``tx.update`` + ``apply_updates`` and through ``ftopt.step(..., backend="eager")``; params
  must match the float64 reference after every step to a relative 1e-6 (see FLOOR), and the
  updates returned by ``tx.update`` must match the reference's update to a relative 1e-5.
* fp16 / bf16 params (fp32 state): one step from the same start equals the float64 reference
  rounded once to the 16-bit type within 1 ulp; over 10 steps, with the reference re-fed
  ftopt's 16-bit params before each step, within 1 ulp at every step.
* fp32 ftopt against torch.optim in fp32 over 20 steps, relative 1e-5.
"""

from __future__ import annotations

import optree
import pytest
import reference as R
import reference_dog as RD
import reference_noise as RZ
import reference_norms as RN
import reference_prodigy as RP
import reference_variants as RV
import torch
from registry import by_trait, names, require

import ftopt

SHAPES = {"w": (7, 5), "b": (33,), "s": (), "t": (4, 3, 2), "z": (6,)}
ZERO_INIT = "z"  # starts at exactly 0: trust ratio 1 where |p| = 0, clip limit 0 where |p| = 0
STEPS = 20
STEPS_16 = 10
SEED = 20240611
ZERO_FRAC = 0.1  # exact-zero grads: exercise sign(0) = 0 (Lion) and "where s > 0" (adagrad)

# Tolerance |a - b| <= RTOL * max(|b|, FLOOR).  FLOOR = 1.0 is the scale of the params (drawn from
# N(0, 1)): fp32 rounding of p + u happens at the magnitude of the parameter, so an element that
# drifts near 0 still carries absolute error ~1e-7 from earlier steps; dividing that by its tiny
# |b| would flag correct code.  The updates are 1e-3..1e-2 per step, so any error in the update
# math above ~1e-4 relative still shows up at this tolerance, and the direct update comparison
# below is relative to each leaf's largest update.
RTOL = 1e-6
FLOOR = 1.0
UPDATE_RTOL = 1e-5
TORCH_RTOL = 1e-5

sc = ftopt  # short alias for the chains below

CASES = {
    # ---- optax aliases (non-default hyperparameters; weight decay > 0 where the alias has it)
    "sgd": (lambda: ftopt.sgd(0.05), lambda: R.RefSGD(0.05)),
    "sgd_momentum": (
        lambda: ftopt.sgd(0.05, momentum=0.8),
        lambda: R.RefSGD(0.05, momentum=0.8),
    ),
    "sgd_nesterov": (
        lambda: ftopt.sgd(0.05, momentum=0.8, nesterov=True),
        lambda: R.RefSGD(0.05, momentum=0.8, nesterov=True),
    ),
    "adam": (
        lambda: ftopt.adam(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-4),
        lambda: R.RefAdam(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-4),
    ),
    "adam_nesterov": (
        lambda: ftopt.adam(0.01, b1=0.85, b2=0.97, eps=1e-4, nesterov=True),
        lambda: R.RefAdam(0.01, b1=0.85, b2=0.97, eps=1e-4, nesterov=True),
    ),
    "adamw": (
        lambda: ftopt.adamw(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5, weight_decay=0.1),
        lambda: R.RefAdamW(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5, weight_decay=0.1),
    ),
    "adamw_nesterov": (
        lambda: ftopt.adamw(0.01, b1=0.85, b2=0.99, eps=1e-4, weight_decay=0.2, nesterov=True),
        lambda: R.RefAdamW(0.01, b1=0.85, b2=0.99, eps=1e-4, weight_decay=0.2, nesterov=True),
    ),
    "lion": (
        lambda: ftopt.lion(0.01, b1=0.8, b2=0.95, weight_decay=0.3),
        lambda: R.RefLion(0.01, b1=0.8, b2=0.95, weight_decay=0.3),
    ),
    "rmsprop": (
        lambda: ftopt.rmsprop(0.01, decay=0.8, eps=1e-3, initial_scale=0.5),
        lambda: R.RefRMSprop(0.01, decay=0.8, eps=1e-3, initial_scale=0.5),
    ),
    "rmsprop_eps_outside": (
        lambda: ftopt.rmsprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False),
        lambda: R.RefRMSprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False),
    ),
    "rmsprop_centered": (
        lambda: ftopt.rmsprop(0.01, decay=0.8, eps=1e-3, initial_scale=0.5, centered=True),
        lambda: R.RefRMSprop(0.01, decay=0.8, eps=1e-3, initial_scale=0.5, centered=True),
    ),
    "rmsprop_centered_eps_outside": (
        lambda: ftopt.rmsprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False, centered=True,
                              momentum=0.5),
        lambda: R.RefRMSprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False, centered=True,
                             momentum=0.5),
    ),
    "rmsprop_momentum": (
        lambda: ftopt.rmsprop(0.01, decay=0.9, eps=1e-2, initial_scale=0.1, momentum=0.7),
        lambda: R.RefRMSprop(0.01, decay=0.9, eps=1e-2, initial_scale=0.1, momentum=0.7),
    ),
    "rmsprop_nesterov": (
        lambda: ftopt.rmsprop(0.01, decay=0.9, eps=1e-3, eps_in_sqrt=False, momentum=0.6,
                              nesterov=True),
        lambda: R.RefRMSprop(0.01, decay=0.9, eps=1e-3, eps_in_sqrt=False, momentum=0.6,
                             nesterov=True),
    ),
    "adagrad": (
        lambda: ftopt.adagrad(0.1, initial_accumulator_value=0.3, eps=1e-3),
        lambda: R.RefAdagrad(0.1, initial_accumulator_value=0.3, eps=1e-3),
    ),
    "adagrad_iav0": (
        lambda: ftopt.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-4),
        lambda: R.RefAdagrad(0.1, initial_accumulator_value=0.0, eps=1e-4),
    ),
    "adagrad_iav0_eps0": (  # s == 0 for never-nonzero grads: u must be 0 there, not 0/0
        lambda: ftopt.adagrad(0.1, initial_accumulator_value=0.0, eps=0.0),
        lambda: R.RefAdagrad(0.1, initial_accumulator_value=0.0, eps=0.0),
    ),
    "lamb": (
        lambda: ftopt.lamb(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5, weight_decay=0.1),
        lambda: R.RefLamb(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5, weight_decay=0.1),
    ),
    "lars": (
        lambda: ftopt.lars(0.5, weight_decay=0.1, trust_coefficient=0.02, eps=0.01, momentum=0.8),
        lambda: R.RefLars(0.5, weight_decay=0.1, trust_coefficient=0.02, eps=0.01, momentum=0.8),
    ),
    "lars_masked": (  # the trust ratio on matrices (and higher) only
        lambda: ftopt.lars(0.5, weight_decay=0.1, trust_coefficient=0.02, momentum=0.8,
                           trust_ratio_mask=lambda p: ftopt.tree.map(lambda x: x.ndim >= 2, p)),
        lambda: R.RefLars(0.5, weight_decay=0.1, trust_coefficient=0.02, momentum=0.8,
                          trust_ratio_mask=lambda p: p.ndim >= 2),
    ),
    "lars_nesterov": (
        lambda: ftopt.lars(0.5, weight_decay=0.05, trust_coefficient=0.03, momentum=0.7,
                           nesterov=True),
        lambda: R.RefLars(0.5, weight_decay=0.05, trust_coefficient=0.03, momentum=0.7,
                          nesterov=True),
    ),
    "ademamix": (
        lambda: ftopt.ademamix(0.01, b1=0.8, b2=0.95, b3=0.99, alpha=3.0, eps=1e-3,
                               eps_root=1e-5, weight_decay=0.1),
        lambda: R.RefAdEMAMix(0.01, b1=0.8, b2=0.95, b3=0.99, alpha=3.0, eps=1e-3,
                              eps_root=1e-5, weight_decay=0.1),
    ),
    # ---- ftopt.alias_variants (reference_variants.py)
    "adamax": (
        lambda: ftopt.adamax(0.01, b1=0.8, b2=0.95, eps=1e-3),
        lambda: RV.RefAdamax(0.01, b1=0.8, b2=0.95, eps=1e-3),
    ),
    "adamaxw": (
        lambda: ftopt.adamaxw(0.01, b1=0.85, b2=0.99, eps=1e-4, weight_decay=0.1),
        lambda: RV.RefAdamax(0.01, b1=0.85, b2=0.99, eps=1e-4, weight_decay=0.1),
    ),
    "amsgrad": (
        lambda: ftopt.amsgrad(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5),
        lambda: RV.RefAmsgrad(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5),
    ),
    "amsgrad_uncorrected": (  # the original paper: no bias corrections
        lambda: ftopt.amsgrad(0.01, b1=0.8, b2=0.9, eps=1e-3, bias_correction_mu=False,
                              bias_correction_nu=False),
        lambda: RV.RefAmsgrad(0.01, b1=0.8, b2=0.9, eps=1e-3, bias_correction_mu=False,
                              bias_correction_nu=False),
    ),
    "nadam": (
        lambda: ftopt.nadam(0.01, b1=0.85, b2=0.97, eps=1e-4, eps_root=1e-5),
        lambda: RV.RefNAdamW(0.01, b1=0.85, b2=0.97, eps=1e-4, eps_root=1e-5),
    ),
    "nadamw": (
        lambda: ftopt.nadamw(0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.2),
        lambda: RV.RefNAdamW(0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.2),
    ),
    "radam": (  # b2 = 0.95: ro >= 5 from step 6 on, both branches run
        lambda: ftopt.radam(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5),
        lambda: RV.RefRAdam(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5),
    ),
    "radam_nesterov": (
        lambda: ftopt.radam(0.01, b1=0.85, b2=0.9, eps=1e-4, threshold=4.5, nesterov=True),
        lambda: RV.RefRAdam(0.01, b1=0.85, b2=0.9, eps=1e-4, threshold=4.5, nesterov=True),
    ),
    "acprop": (
        lambda: ftopt.acprop(0.01, b1=0.8, b2=0.95, eps=1e-4, eps_root=1e-6,
                             weight_decay=0.1),
        lambda: RV.RefACProp(0.01, b1=0.8, b2=0.95, eps=1e-4, eps_root=1e-6,
                             weight_decay=0.1),
    ),
    "acprop_defaults": (
        lambda: ftopt.acprop(0.01), lambda: RV.RefACProp(0.01),
    ),
    "adabelief": (
        lambda: ftopt.adabelief(0.01, b1=0.8, b2=0.95, eps=1e-4, eps_root=1e-6,
                                weight_decay=0.1),
        lambda: RV.RefAdaBelief(0.01, b1=0.8, b2=0.95, eps=1e-4, eps_root=1e-6,
                                weight_decay=0.1),
    ),
    "adabelief_nesterov": (
        lambda: ftopt.adabelief(0.01, b1=0.85, b2=0.99, eps=1e-3, nesterov=True),
        lambda: RV.RefAdaBelief(0.01, b1=0.85, b2=0.99, eps=1e-3, nesterov=True),
    ),
    "yogi": (
        lambda: ftopt.yogi(0.01, b1=0.8, b2=0.95, eps=1e-3),
        lambda: RV.RefYogi(0.01, b1=0.8, b2=0.95, eps=1e-3),
    ),
    "mars": (
        lambda: ftopt.mars(0.01, b1=0.9, b2=0.95, eps=1e-6, gamma=0.3, weight_decay=0.1),
        lambda: RV.RefMars(0.01, b1=0.9, b2=0.95, eps=1e-6, gamma=0.3, weight_decay=0.1),
    ),
    "mars_unclipped": (
        lambda: ftopt.mars(0.01, gamma=0.1, clip_threshold=None),
        lambda: RV.RefMars(0.01, gamma=0.1, clip_threshold=None),
    ),
    "ano": (
        lambda: ftopt.ano(0.01, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1),
        lambda: RV.RefAno(0.01, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1),
    ),
    "ano_logarithmic": (
        lambda: ftopt.ano(0.01, b2=0.9, logarithmic_schedule=True),
        lambda: RV.RefAno(0.01, b2=0.9, logarithmic_schedule=True),
    ),
    "adadelta": (
        lambda: ftopt.adadelta(1.0, rho=0.8, eps=1e-3, weight_decay=0.1),
        lambda: RV.RefAdadelta(1.0, rho=0.8, eps=1e-3, weight_decay=0.1),
    ),
    "adadelta_default_lr": (  # learning_rate=None: 1.0, a descent
        lambda: ftopt.adadelta(rho=0.9, eps=1e-2),
        lambda: RV.RefAdadelta(1.0, rho=0.9, eps=1e-2),
    ),
    "sign_sgd": (lambda: ftopt.sign_sgd(0.01), lambda: RV.RefSignSGD(0.01)),
    "signum": (lambda: ftopt.signum(0.01, beta=0.8), lambda: RV.RefSignum(0.01, beta=0.8)),
    "optimistic_gradient_descent": (
        lambda: ftopt.optimistic_gradient_descent(0.05, alpha=0.7, beta=0.4),
        lambda: RV.RefOptimisticGD(0.05, alpha=0.7, beta=0.4),
    ),
    "optimistic_adam_v2": (
        lambda: ftopt.optimistic_adam_v2(0.01, alpha=0.8, beta=0.5, b1=0.85, b2=0.99,
                                         eps=1e-3),
        lambda: RV.RefOptimisticAdam(0.01, alpha=0.8, beta=0.5, b1=0.85, b2=0.99, eps=1e-3),
    ),
    "optimistic_adam": (  # optax's older interface: v2 with lr 1, alpha = lr, beta = optimism
        lambda: ftopt.optimistic_adam(0.01, 0.3, b1=0.85, b2=0.99, eps=1e-3),
        lambda: RV.RefOptimisticAdam(1.0, alpha=0.01, beta=0.3, b1=0.85, b2=0.99, eps=1e-3),
    ),
    "optimistic_adam_v2_plain": (
        lambda: ftopt.optimistic_adam_v2(0.02, b1=0.9, b2=0.95, eps=1e-2, nesterov=False),
        lambda: RV.RefOptimisticAdam(0.02, b1=0.9, b2=0.95, eps=1e-2, nesterov=False),
    ),
    "adopt": (
        lambda: ftopt.adopt(0.01, b1=0.8, b2=0.95, eps=1e-3),
        lambda: RV.RefAdopt(0.01, b1=0.8, b2=0.95, eps=1e-3),
    ),
    "adopt_nesterov_unclipped": (
        lambda: ftopt.adopt(0.01, b1=0.85, b2=0.99, eps=1e-2, nesterov=True,
                            use_clipping=False),
        lambda: RV.RefAdopt(0.01, b1=0.85, b2=0.99, eps=1e-2, nesterov=True,
                            use_clipping=False),
    ),
    "simplified_ademamix": (
        lambda: ftopt.simplified_ademamix(0.002, b1=0.9, b2=0.95, alpha=2.0, eps=1e-3,
                                          eps_root=1e-5, weight_decay=0.1),
        lambda: RV.RefSimplifiedAdEMAMix(0.002, b1=0.9, b2=0.95, alpha=2.0, eps=1e-3,
                                         eps_root=1e-5, weight_decay=0.1),
    ),
    # ---- ftopt.alias_more (reference_variants.py)
    "adan": (
        lambda: ftopt.adan(0.01, b1=0.8, b2=0.9, b3=0.95, eps=1e-3, eps_root=1e-5,
                           weight_decay=0.1),
        lambda: RV.RefAdan(0.01, b1=0.8, b2=0.9, b3=0.95, eps=1e-3, eps_root=1e-5,
                           weight_decay=0.1),
    ),
    "cocob": (
        lambda: ftopt.cocob(0.5, alpha=20.0, eps=1e-3, weight_decay=0.1),
        lambda: RV.RefCOCOB(0.5, alpha=20.0, eps=1e-3, weight_decay=0.1),
    ),
    "madgrad": (
        lambda: ftopt.madgrad(0.01, momentum=0.8, weight_decay=0.1, eps=1e-4),
        lambda: RV.RefMadgrad(0.01, momentum=0.8, weight_decay=0.1, eps=1e-4),
    ),
    "madgrad_no_momentum": (
        lambda: ftopt.madgrad(0.02, momentum=0.0),
        lambda: RV.RefMadgrad(0.02, momentum=0.0),
    ),
    "rprop": (  # max 0.02: some step sizes reach the clip
        lambda: ftopt.rprop(0.01, eta_minus=0.4, eta_plus=1.3, min_step_size=2e-3,
                            max_step_size=0.02),
        lambda: RV.RefRprop(0.01, eta_minus=0.4, eta_plus=1.3, min_step_size=2e-3,
                            max_step_size=0.02),
    ),
    # Schedule-Free's update reads y − z with a weight ~1: the fp32 rounding of the params
    # (~6e-8) enters it directly, so the learning rates keep updates >= ~1e-2 (the update
    # comparison is relative 1e-5). Warmup: the averaging weights change over 3 steps.
    "schedule_free_sgd": (
        lambda: ftopt.schedule_free_sgd(0.3, warmup_steps=3, b1=0.8, weight_decay=0.1),
        lambda: RV.RefScheduleFree(0.3, warmup_steps=3, b1=0.8, weight_decay=0.1),
    ),
    "schedule_free_adamw": (
        lambda: ftopt.schedule_free_adamw(0.05, b1=0.9, b2=0.95, eps=1e-3, weight_decay=0.1,
                                          weight_lr_power=1.5),
        lambda: RV.RefScheduleFree(0.05, b1=0.9, weight_decay=0.1, power=1.5, adam=True,
                                   b2=0.95, eps=1e-3),
    ),
    # ---- ftopt.alias_norms (reference_norms.py)
    "novograd": (
        lambda: ftopt.novograd(0.01, b1=0.8, b2=0.5, eps=1e-3, eps_root=1e-5,
                               weight_decay=0.1),
        lambda: RN.RefNovograd(0.01, b1=0.8, b2=0.5, eps=1e-3, eps_root=1e-5,
                               weight_decay=0.1),
    ),
    "fromage": (lambda: ftopt.fromage(0.05, min_norm=1e-3),
                lambda: RN.RefFromage(0.05, min_norm=1e-3)),
    # ---- ftopt.alias_prodigy (reference_prodigy.py): a larger first estimate, so that
    # the estimate grows within the test's steps
    "prodigy": (lambda: ftopt.prodigy(1.0, betas=(0.9, 0.99), estim_lr0=1e-3,
                                      weight_decay=0.05),
                lambda: RP.RefProdigy(1.0, 0.9, 0.99, estim_lr0=1e-3, weight_decay=0.05)),
    "dadapt_adamw": (lambda: ftopt.dadapt_adamw(1.0, betas=(0.9, 0.99), estim_lr0=1e-3,
                                                weight_decay=0.05),
                     lambda: RP.RefDAdaptAdamW(1.0, 0.9, 0.99, estim_lr0=1e-3,
                                               weight_decay=0.05)),
    # ---- bitsandbytes rows of SPEC §4 (Adam/AdamW, AdEMAMix, Lion rows are the aliases above)
    "bnb_sgd": (
        lambda: sc.chain(sc.add_decayed_weights(0.05), sc.trace(decay=0.7),
                         sc.scale_by_learning_rate(0.05)),
        lambda: R.RefBnbSGD(0.05, momentum=0.7, weight_decay=0.05),
    ),
    "bnb_rmsprop": (
        lambda: sc.chain(sc.add_decayed_weights(0.1),
                         sc.scale_by_rms(decay=0.9, eps=1e-3, eps_in_sqrt=False),
                         sc.scale_by_learning_rate(0.01)),
        lambda: R.RefBnbRMSprop(0.01, alpha=0.9, eps=1e-3, weight_decay=0.1),
    ),
    "bnb_adagrad": (
        lambda: sc.chain(sc.add_decayed_weights(0.1),
                         sc.scale_by_rss(initial_accumulator_value=0.0, eps=1e-3,
                                         eps_in_sqrt=False),
                         sc.scale_by_learning_rate(0.1)),
        lambda: R.RefBnbAdagrad(0.1, eps=1e-3, weight_decay=0.1),
    ),
    "bnb_lamb": (
        lambda: sc.chain(sc.scale_by_adam(b1=0.8, b2=0.95, eps=1e-3),
                         sc.clip_by_param_norm_ratio(0.8), sc.add_decayed_weights(0.1),
                         sc.scale_by_learning_rate(0.01)),
        lambda: R.RefBnbLamb(0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1, max_unorm=0.8),
    ),
    "bnb_lars": (
        lambda: sc.chain(sc.add_decayed_weights(0.1), sc.trace(decay=0.8),
                         sc.clip_by_param_norm_ratio(0.2), sc.scale_by_learning_rate(0.5)),
        lambda: R.RefBnbLars(0.5, momentum=0.8, weight_decay=0.1, max_unorm=0.2),
    ),
}

# DoG and DoWG (tests/reference_dog.py): one step size for the tree, from global norms.
# The step grows with the distance travelled, which feeds back the rounding of every
# earlier step (as Prodigy's estimate does), and ‖x₀ − p‖ is a difference of fp32 params
# (relative error ~ulp(p)/|x₀ − p|): hyperparameters whose steps travel far enough for 20
# steps to stay within the trajectory tolerance; each step from the same state, and the
# defaults: tests/test_dog.py.
CASES["dog"] = (lambda: ftopt.dog(1.0, ("heuristic", 1e-2), eps=1e-8, weight_decay=0.05),
                lambda: RD.RefDoG(1.0, ("heuristic", 1e-2), eps=1e-8, weight_decay=0.05))
CASES["dog_distance"] = (lambda: ftopt.dog(0.5, ("distance", 0.1)),
                         lambda: RD.RefDoG(0.5, ("distance", 0.1)))
CASES["dog_learning_rate"] = (lambda: ftopt.dog(1.0, ("learning_rate", 0.05)),
                              lambda: RD.RefDoG(1.0, ("learning_rate", 0.05)))
CASES["dowg"] = (lambda: ftopt.dowg(0.3, init_estim_sq_dist=0.01, weight_decay=0.05),
                 lambda: RD.RefDoWG(0.3, init_estim_sq_dist=0.01, weight_decay=0.05))
CASES["noisy_sgd"] = (lambda: ftopt.noisy_sgd(0.05, eta=0.02, gamma=0.6, seed=77),
                      lambda: RZ.RefNoisySGD(0.05, eta=0.02, gamma=0.6, seed=77))

NAMES = sorted(CASES)
# ADOPT's first step only measures the second moment: its update is exactly zero.
# rprop and schedule_free_sgd (its warmup's lr is 0 at count 0): as optax.
FIRST_STEP_MOVES_NOTHING = {"adopt", "adopt_nesterov_unclipped", "rprop", "schedule_free_sgd"}

# The reference case of each alias of the test registry (``tests/registry.py``), by registry
# name: a new alias there fails test_every_registry_alias_has_a_reference until it has one.
REGISTRY_CASES = {
    "sgd": "sgd", "sgd[momentum]": "sgd_momentum", "adam": "adam", "adamw": "adamw",
    "lion": "lion", "rmsprop": "rmsprop", "rmsprop[momentum]": "rmsprop_momentum",
    "rmsprop[centered]": "rmsprop_centered",
    "adagrad": "adagrad", "lamb": "lamb", "lars": "lars", "lars[masked]": "lars_masked",
    "ademamix": "ademamix",
    "adamax": "adamax", "adamaxw": "adamaxw", "amsgrad": "amsgrad", "nadam": "nadam",
    "nadamw": "nadamw", "radam": "radam", "adabelief": "adabelief", "yogi": "yogi", "ano": "ano",
    "mars": "mars",
    "acprop": "acprop",
    "adadelta": "adadelta", "sign_sgd": "sign_sgd", "signum": "signum",
    "optimistic_gradient_descent": "optimistic_gradient_descent", "adopt": "adopt",
    "optimistic_adam_v2": "optimistic_adam_v2", "cocob": "cocob",
    "optimistic_adam": "optimistic_adam",
    "simplified_ademamix": "simplified_ademamix",
    "adan": "adan", "madgrad": "madgrad", "rprop": "rprop", "noisy_sgd": "noisy_sgd",
    "schedule_free_sgd": "schedule_free_sgd", "schedule_free_adamw": "schedule_free_adamw",
    "novograd": "novograd", "fromage": "fromage", "prodigy": "prodigy",
    "dog": "dog", "dowg": "dowg", "dadapt_adamw": "dadapt_adamw",
}
PATHS = ["update", "step_eager"]


# --------------------------------------------------------------------------- helpers


def _params(gen, dtype):
    out = {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}
    out[ZERO_INIT] = torch.zeros(SHAPES[ZERO_INIT], dtype=dtype)
    return out


def _grads(gen, dtype):
    out = {}
    for k, s in SHAPES.items():
        g = 0.1 * torch.randn(s, generator=gen)
        g = torch.where(torch.rand(s, generator=gen) < ZERO_FRAC, 0.0, g)
        out[k] = g.to(dtype)
    return out


def _ftopt_step(tx, params, grads, state, path):
    """Returns (new_params, new_state, updates or None)."""
    if path == "update":
        updates, state = tx.update(grads, state, params)
        return ftopt.apply_updates(params, updates), state, updates
    new_params, state = ftopt.step(tx, params, grads, state, backend="eager")
    return new_params, state, None


def _check_dtypes(params, dtype):
    assert set(params) == set(SHAPES)
    for k, v in params.items():
        assert v.dtype == dtype, (k, v.dtype)
        assert tuple(v.shape) == SHAPES[k], (k, v.shape)


def _update_err(updates, ref_updates):
    """max|u - u_ref| / max|u_ref|, both maxima over the whole tree.

    The scale is tree-wide, not per leaf: a 0-d leaf whose adam direction nearly cancels its
    decay term (u ~ 1e-5 * lr) carries fp32 cancellation error that is tiny in absolute terms
    but not relative to its own size.
    """
    scale = max(float(ur.abs().max()) for ur in ref_updates.values() if ur.numel())
    if scale == 0.0:  # a step that moves nothing (ADOPT's first): exactly zero updates
        zero = all(not bool(updates[k].detach().ne(0).any()) for k in ref_updates)
        return 0.0 if zero else float("inf")
    worst = 0.0
    for k, ur in ref_updates.items():
        u = updates[k].detach().to(torch.float64)
        if not bool(torch.isfinite(u).all()):
            return float("inf")
        if ur.numel():
            worst = max(worst, float((u - ur).abs().max()) / scale)
    return worst


def _ordered(x):
    """16-bit floats -> integers that are consecutive for consecutive representable values."""
    i = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def _max_ulp(actual, expected):
    worst = 0
    for k, b in expected.items():
        a = actual[k]
        assert a.dtype == b.dtype, (k, a.dtype, b.dtype)
        assert bool(torch.isfinite(a).all()), k
        worst = max(worst, int((_ordered(a) - _ordered(b)).abs().max()))
    return worst


def _run_fp32(name, path, make_ref=None):
    make_tx, default_ref = CASES[name]
    gen = torch.Generator().manual_seed(SEED)
    params = _params(gen, torch.float32)
    start = {k: v.clone() for k, v in params.items()}
    tx, ref = make_tx(), (make_ref or default_ref)()
    state = tx.init(params)
    rparams = {k: v.to(torch.float64) for k, v in params.items()}
    for step in range(1, STEPS + 1):
        grads = _grads(gen, torch.float32)
        params, state, updates = _ftopt_step(tx, params, grads, state, path)
        rparams = ref.step(rparams, grads)
        _check_dtypes(params, torch.float32)
        err = R.max_rel_err(params, rparams, FLOOR)
        assert err <= RTOL, f"{name}/{path} step {step}: param rel err {err:.3e}"
        if updates is not None:
            uerr = _update_err(updates, ref.last_update)
            assert uerr <= UPDATE_RTOL, f"{name} step {step}: update rel err {uerr:.3e}"
    # the run moved the params well beyond the tolerance (the comparison is not vacuous)
    assert R.max_rel_err(params, start, FLOOR) > 1e-3
    return ref


# --------------------------------------------------------------------------- fp32 vs reference


# Matrix-stage aliases (``mixes``): float64 references in tests/test_matrix_optimizers.py.
@pytest.mark.parametrize("name", names(by_trait(kind="alias", mixes=False)))
def test_every_registry_alias_has_a_reference(name):
    """Each registry alias is checked against a float64 reference formula (reference.py)."""
    case = require(REGISTRY_CASES, name, "float64 reference case",
                   "REGISTRY_CASES (and CASES, with a reference.py class) in "
                   "tests/test_aliases_vs_reference.py")
    assert case in CASES, case
    assert CASES[case][0]().init  # builds


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_reference(name, path):
    ref = _run_fp32(name, path)
    if name in ("bnb_lamb", "bnb_lars"):  # both branches of clip_by_param_norm_ratio were taken
        assert any(ref.clip_log) and not all(ref.clip_log), ref.clip_log
    if name.startswith("radam"):  # both branches: the momentum alone, then rectified
        assert any(ref.rectified) and not all(ref.rectified), ref.rectified


@pytest.mark.parametrize(
    "name, wrong_ref",
    [
        # weight decay off by 1%
        ("adamw", lambda: R.RefAdamW(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5,
                                     weight_decay=0.101)),
        # eps inside the sqrt instead of outside
        ("rmsprop_eps_outside", lambda: R.RefRMSprop(0.01, decay=0.95, eps=1e-3)),
        # the LARS row without its clip (plain SGD momentum with coupled decay)
        ("bnb_lars", lambda: R.RefBnbSGD(0.5, momentum=0.8, weight_decay=0.1)),
        # RAdam rectifying from ro >= 4.5 instead of 5 (one step earlier)
        ("radam", lambda: RV.RefRAdam(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5,
                                      threshold=4.5)),
        # ADOPT without its clipping
        ("adopt", lambda: RV.RefAdopt(0.01, b1=0.8, b2=0.95, eps=1e-3, use_clipping=False)),
        # AMSGrad's maximum of the uncorrected nu (torch's amsgrad=True keeps that one)
        ("amsgrad", lambda: RV.RefAmsgrad(0.01, b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5,
                                          bias_correction_nu=False)),
        # Adan's gradient difference from the first step on (optax's is 0 there)
        ("adan", lambda: _AdanWithoutFirstStep(0.01, b1=0.8, b2=0.9, b3=0.95, eps=1e-3,
                                               eps_root=1e-5, weight_decay=0.1)),
        # MADGRAD without the eps added to the learning rate
        ("madgrad", lambda: RV.RefMadgrad(0.01 - 1e-4, momentum=0.8, weight_decay=0.1,
                                          eps=1e-4)),
        # torch.optim.Rprop's timing (the step for sign(g_t) taken at t)
        ("rprop", lambda: _RpropNoLag(0.01, eta_minus=0.4, eta_plus=1.3, min_step_size=2e-3,
                                      max_step_size=0.02)),
        # Schedule-Free's averaging weights from lr, not lr**2 (they differ in the warmup)
        ("schedule_free_sgd", lambda: RV.RefScheduleFree(0.3, warmup_steps=3, b1=0.8,
                                                         weight_decay=0.1, power=1.0)),
        # NovoGrad's second moment without its first-step init (an EMA from 0)
        ("novograd", lambda: _NovogradNoFirstStep(0.01, b1=0.8, b2=0.5, eps=1e-3,
                                                  eps_root=1e-5, weight_decay=0.1)),
        # Fromage without the 1/sqrt(1 + lr^2) shrink
        ("fromage", lambda: _FromageNoShrink(0.05, min_norm=1e-3)),
        # the noise's variance 2% off
        ("noisy_sgd", lambda: RZ.RefNoisySGD(0.05, eta=0.0204, gamma=0.6, seed=77)),
        # the trust ratio on every leaf, not only on the masked ones
        ("lars_masked", lambda: R.RefLars(0.5, weight_decay=0.1, trust_coefficient=0.02,
                                          momentum=0.8)),
    ],
)
def test_tolerance_catches_small_mistakes(name, wrong_ref):
    """The fp32 comparison is sharp enough to reject slightly wrong math."""
    with pytest.raises(AssertionError):
        _run_fp32(name, "update", make_ref=wrong_ref)


class _AdanWithoutFirstStep(RV.RefAdan):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_diff_zero = False


class _NovogradNoFirstStep(RN.RefNovograd):
    def leaf_update(self, p, g, st, t):
        return super().leaf_update(p, g, st, t + 1)


class _FromageNoShrink(RN.RefFromage):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shrink = False


class _RpropNoLag(RV.RefRprop):
    def leaf_update(self, p, g, st, t):
        super().leaf_update(p, g, st, t)
        return -st["prev_updates"]


# --------------------------------------------------------------------------- 16-bit params


DTYPES_16 = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES_16, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_16bit_one_step_rounds_once(name, dtype, path):
    make_tx, make_ref = CASES[name]
    gen = torch.Generator().manual_seed(SEED + 1)
    params, grads = _params(gen, dtype), _grads(gen, dtype)
    tx, ref = make_tx(), make_ref()
    state = tx.init(params)
    new, state, _ = _ftopt_step(tx, params, grads, state, path)
    _check_dtypes(new, dtype)
    leaves = optree.tree_leaves(state)
    float_states = [x for x in leaves if torch.is_tensor(x) and x.is_floating_point()]
    assert all(x.dtype == torch.float32 for x in float_states)  # fp32 state (sgd: none)
    expected = {k: v.to(dtype) for k, v in ref.step(params, grads).items()}
    assert _max_ulp(new, expected) <= 1
    if name in FIRST_STEP_MOVES_NOTHING:
        assert all(torch.equal(new[k], params[k]) for k in params)
    else:
        assert any(not torch.equal(new[k], params[k]) for k in params)  # the step did something


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES_16, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_16bit_resynced_steps(name, dtype, path):
    make_tx, make_ref = CASES[name]
    gen = torch.Generator().manual_seed(SEED + 2)
    params = _params(gen, dtype)
    tx, ref = make_tx(), make_ref()
    state = tx.init(params)
    for step in range(1, STEPS_16 + 1):
        grads = _grads(gen, dtype)
        # the reference starts each step from ftopt's current 16-bit params (resync)
        expected = {k: v.to(dtype) for k, v in ref.step(params, grads).items()}
        params, state, _ = _ftopt_step(tx, params, grads, state, path)
        _check_dtypes(params, dtype)
        ulps = _max_ulp(params, expected)
        assert ulps <= 1, f"{name}/{dtype}/{path} step {step}: {ulps} ulp"


# --------------------------------------------------------------------------- vs torch.optim fp32

TORCH_CASES = {
    "adam": (
        lambda: ftopt.adam(0.01, b1=0.8, b2=0.95, eps=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-3),
    ),
    "adamw": (
        lambda: ftopt.adamw(0.01, b1=0.85, b2=0.99, eps=1e-4, weight_decay=0.2),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.85, 0.99), eps=1e-4, weight_decay=0.2),
    ),
    "sgd_momentum": (
        lambda: ftopt.sgd(0.05, momentum=0.8),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8),
    ),
    "sgd_nesterov": (
        lambda: ftopt.sgd(0.05, momentum=0.8, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    ),
    "rmsprop": (
        lambda: ftopt.rmsprop(0.01, decay=0.9, eps=1e-3, eps_in_sqrt=False),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-3),
    ),
    "rmsprop_momentum": (
        lambda: ftopt.rmsprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False, momentum=0.6),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.95, eps=1e-3, momentum=0.6),
    ),
    "rmsprop_centered": (
        lambda: ftopt.rmsprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False, centered=True,
                              momentum=0.6),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.95, eps=1e-3, momentum=0.6,
                                       centered=True),
    ),
    "adagrad_eps0": (  # eps = 0: optax's "inside the sqrt" equals torch's "outside"
        lambda: ftopt.adagrad(0.1, initial_accumulator_value=0.2, eps=0.0),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.2, eps=0.0),
    ),
    "bnb_sgd": (
        lambda: sc.chain(sc.add_decayed_weights(0.05), sc.trace(decay=0.7),
                         sc.scale_by_learning_rate(0.05)),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.7, weight_decay=0.05),
    ),
    "adamax": (
        lambda: ftopt.adamax(0.01, b1=0.8, b2=0.95, eps=1e-3),
        lambda ps: torch.optim.Adamax(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-3),
    ),
    "adamax_coupled_decay": (  # torch's weight_decay is an L2 term added to the gradient
        lambda: sc.chain(sc.add_decayed_weights(0.1),
                         sc.scale_by_adamax(b1=0.85, b2=0.99, eps=1e-4),
                         sc.scale_by_learning_rate(0.01)),
        lambda ps: torch.optim.Adamax(ps, lr=0.01, betas=(0.85, 0.99), eps=1e-4,
                                      weight_decay=0.1),
    ),
    "radam": (  # eps small against sqrt(v_hat): torch's eps placement differs below 1e-5
        lambda: ftopt.radam(0.01, b1=0.8, b2=0.95, eps=1e-8),
        lambda ps: torch.optim.RAdam(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-8),
    ),
    "adadelta": (
        lambda: ftopt.adadelta(1.0, rho=0.8, eps=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.Adadelta(ps, lr=1.0, rho=0.8, eps=1e-3, weight_decay=0.1),
    ),
    "bnb_rmsprop": (
        lambda: sc.chain(sc.add_decayed_weights(0.1),
                         sc.scale_by_rms(decay=0.9, eps=1e-3, eps_in_sqrt=False),
                         sc.scale_by_learning_rate(0.01)),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-3, weight_decay=0.1),
    ),
    "bnb_adagrad": (
        lambda: sc.chain(sc.add_decayed_weights(0.1),
                         sc.scale_by_rss(initial_accumulator_value=0.0, eps=1e-3,
                                         eps_in_sqrt=False),
                         sc.scale_by_learning_rate(0.1)),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1, eps=1e-3),
    ),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_fp32_matches_torch_optim(name, path):
    make_tx, make_torch = TORCH_CASES[name]
    gen = torch.Generator().manual_seed(SEED + 3)
    params = _params(gen, torch.float32)
    tparams = [torch.nn.Parameter(params[k].clone()) for k in SHAPES]
    opt = make_torch(tparams)
    tx = make_tx()
    state = tx.init(params)
    for step in range(1, STEPS + 1):
        grads = _grads(gen, torch.float32)
        for k, p in zip(SHAPES, tparams):
            p.grad = grads[k].clone()
        opt.step()
        params, state, _ = _ftopt_step(tx, params, grads, state, path)
        expected = {k: p.detach() for k, p in zip(SHAPES, tparams)}
        err = R.max_rel_err(params, expected, FLOOR)
        assert err <= TORCH_RTOL, f"{name}/{path} step {step}: rel err {err:.3e}"
