"""optax's top-level names (its optimizers, transforms, wrappers, schedules, types, states
and losses) and optax.contrib's and optax.losses' exist in ftopt, and the aliases of
states and types are what optax makes them."""

from __future__ import annotations

import torch

import ftopt

OPTAX = """
adabelief adadelta adafactor adagrad adam adamax adamaxw adamw adan adaptive_grad_clip
AdaptiveGradClipState add_decayed_weights add_noise AddDecayedWeightsState AddNoiseState
amsgrad apply_every apply_if_finite apply_updates ApplyEvery ApplyIfFiniteState centralize
chain clip_by_block_rms clip_by_global_norm clip ClipByGlobalNormState ClipState
conditionally_mask ConditionallyMaskState conditionally_transform
ConditionallyTransformState constant_schedule cosine_decay_schedule
cosine_onecycle_schedule ema EmaState EmptyState exponential_decay FactoredState flatten
fromage global_norm GradientTransformation GradientTransformationExtraArgs identity
incremental_update inject_hyperparams InjectHyperparamsState join_schedules
keep_params_nonnegative lamb lars lbfgs lion linear_onecycle_schedule linear_schedule
lookahead LookaheadParams LookaheadState masked MaskedState matrix_inverse_pth_root
multi_normal multi_transform MultiSteps MultiStepsState MultiTransformState nadam nadamw
nnls noisy_sgd novograd NonNegativeParamsState OptState Params partition PartitionState
periodic_update per_example_global_norm_clip per_example_layer_norm_clip
piecewise_constant_schedule piecewise_interpolate_schedule polynomial_schedule
power_iteration polyak_sgd radam rmsprop rprop safe_increment safe_int32_increment
safe_norm safe_root_mean_squares ScalarOrSchedule scale_by_adadelta scale_by_adam
scale_by_adamax scale_by_adan scale_by_amsgrad scale_by_backtracking_linesearch
scale_by_belief scale_by_lbfgs scale_by_lion scale_by_factored_rms scale_by_novograd
scale_by_param_block_norm scale_by_param_block_rms scale_by_polyak scale_by_radam
scale_by_rms scale_by_rprop scale_by_rss scale_by_schedule scale_by_sign scale_by_sm3
scale_by_stddev scale_by_trust_ratio scale_by_yogi scale_by_zoom_linesearch
scale_by_learning_rate scale_by_distance_over_gradients scale_by_optimistic_gradient
scale_gradient scale ScaleByAdaDeltaState ScaleByAdamState ScaleByAdanState
ScaleByAmsgradState ScaleByBeliefState ScaleByLBFGSState ScaleByLionState ScaleByRmsState
ScaleByRpropState ScaleByRssState ScaleByRStdDevState ScaleByScheduleState ScaleBySM3State
ScaleByTrustRatioState ScaleByBacktrackingLinesearchState ScaleByZoomLinesearchState
ScaleState Schedule set_to_zero MaskOrFn ShouldSkipUpdateFunction sgd sgdr_schedule
sign_sgd sm3 skip_large_updates
skip_not_finite snapshot SnapshotState measure_with_ema monitor MonitorState stateless
stateless_with_tree_map trace TraceState TransformInitFn TransformUpdateFn
TransformUpdateExtraArgsFn Updates value_and_grad_from_state warmup_constant_schedule
warmup_cosine_decay_schedule warmup_exponential_decay_schedule yogi zero_nans
ZoomLinesearchInfo with_extra_args_support inject_stateful_hyperparams
InjectStatefulHyperparamsState WrappedSchedule optimistic_adam optimistic_adam_v2
optimistic_gradient_descent init_empty_state selective_transform freeze tree projections
schedules transforms microbatch microbatching ArrayTree perturbations assignment
contrib experimental tree_utils tree_map_params bias_correction update_moment update_infinity_moment
update_moment_per_elem_norm losses
convex_kl_divergence cosine_distance cosine_similarity ctc_loss ctc_loss_with_forward_probs
generalized_kl_divergence hinge_loss huber_loss kl_divergence l2_loss log_cosh ntxent
safe_softmax_cross_entropy sigmoid_binary_cross_entropy sigmoid_focal_loss smooth_labels
softmax_cross_entropy softmax_cross_entropy_with_integer_labels squared_error
""".split()

CONTRIB = """
acprop scale_by_acprop ano scale_by_ano mars scale_by_mars add_cautious_weight_decay ademamix
normuon scale_by_normuon NorMuonState soap scale_by_soap
scale_by_ademamix
scale_by_simplified_ademamix
ScaleByAdemamixState ScaleBySimplifiedAdEMAMixState simplified_ademamix adopt
scale_by_adopt cautious CautiousState cocob COCOBState scale_by_cocob
split_real_and_imaginary SplitRealAndImaginaryState dadapt_adamw DAdaptAdamWState dog
DoGState dowg DoWGState galore GaLoreDimensionNumbers GaLoreState scale_by_galore madgrad
MadgradState scale_by_madgrad MechanicState mechanize momo momo_adam MomoAdamState
MomoState muon scale_by_muon differentially_private_aggregate
DifferentiallyPrivateAggregateState dpsgd prodigy ProdigyState reduce_on_plateau
ReduceLROnPlateauState normalize NormalizeState sam SAMState schedule_free schedule_free_adamw
schedule_free_eval_params schedule_free_sgd ScheduleFreeState
hutchinson_estimator_diag_hessian HutchinsonState sophia SophiaState
""".split()


LOSSES = """
convex_kl_divergence ctc_loss ctc_loss_with_forward_probs generalized_kl_divergence
hinge_loss kl_divergence kl_divergence_with_log_targets multiclass_hinge_loss
multiclass_perceptron_loss multiclass_sparsemax_loss perceptron_loss poly_loss_cross_entropy
safe_softmax_cross_entropy sigmoid_binary_cross_entropy sigmoid_focal_loss
softmax_cross_entropy softmax_cross_entropy_with_integer_labels sparsemax_loss
make_fenchel_young_loss ranking_softmax_loss cosine_distance cosine_similarity huber_loss
l2_loss log_cosh squared_error binary_dice_loss dice_loss multiclass_generalized_dice_loss
ntxent triplet_margin_loss smooth_labels
""".split()

# optax.transforms and optax.schedules, less optax's ZeroNansState (ftopt's zero_nans keeps
# no state) and MaskedNode (masked's state holds the selected leaves only, no placeholders)
TRANSFORMS = """
ema EmaState MultiSteps MultiStepsState ShouldSkipUpdateFunction skip_large_updates
skip_not_finite trace TraceState add_decayed_weights add_noise AddNoiseState
adaptive_grad_clip clip clip_by_block_rms clip_by_global_norm per_example_global_norm_clip
per_example_layer_norm_clip unitwise_clip unitwise_norm chain named_chain partition
PartitionState apply_if_finite ApplyIfFiniteState conditionally_mask conditionally_transform
ConditionallyMaskState ConditionallyTransformState ConditionFn keep_params_nonnegative
NonNegativeParamsState zero_nans freeze selective_transform flatten masked MaskedState
measure_with_ema monitor MonitorState snapshot SnapshotState
""".split()
SCHEDULES = """
Schedule StatefulSchedule inject_hyperparams inject_stateful_hyperparams
InjectHyperparamsState InjectStatefulHyperparamsState WrappedSchedule join_schedules
constant_schedule cosine_decay_schedule cosine_onecycle_schedule exponential_decay
linear_onecycle_schedule linear_schedule piecewise_constant_schedule
piecewise_interpolate_schedule polynomial_schedule sgdr_schedule warmup_constant_schedule
warmup_cosine_decay_schedule warmup_exponential_decay_schedule
""".split()

# optax.tree_utils, less JAX's PRNG-key helpers (tree_split_key_like,
# tree_unwrap_random_key_data)
TREE_UTILS = """
NamedTupleKey tree_add tree_add_scale tree_allclose tree_batch_shape tree_bias_correction
tree_cast tree_cast_like tree_clip tree_conj tree_div tree_dtype tree_full_like tree_get
tree_get_all_with_path tree_map_params tree_max tree_min tree_mul tree_norm tree_ones_like
tree_random_like tree_real tree_scale tree_set tree_size tree_sub tree_sum
tree_update_infinity_moment tree_update_moment tree_update_moment_per_elem_norm tree_vdot
tree_where tree_zeros_like
""".split()


def test_optax_s_names_are_here():
    missing = [n for n in OPTAX + CONTRIB if not hasattr(ftopt, n)]
    assert not missing, missing
    assert set(OPTAX + CONTRIB) <= set(ftopt.__all__) | {"projections", "schedules",
                                                          "transforms", "tree"}


def test_the_stateless_transforms_states_are_optax_s_aliases():
    params = {"w": torch.ones(3)}
    for make, state in [(lambda: ftopt.scale(0.5), ftopt.ScaleState),
                        (lambda: ftopt.clip(1.0), ftopt.ClipState),
                        (lambda: ftopt.clip_by_global_norm(1.0), ftopt.ClipByGlobalNormState),
                        (lambda: ftopt.adaptive_grad_clip(0.1), ftopt.AdaptiveGradClipState),
                        (lambda: ftopt.add_decayed_weights(0.1), ftopt.AddDecayedWeightsState),
                        (lambda: ftopt.scale_by_trust_ratio(), ftopt.ScaleByTrustRatioState),
                        (lambda: ftopt.normalize(), ftopt.NormalizeState),
                        (lambda: ftopt.keep_params_nonnegative(),
                         ftopt.NonNegativeParamsState)]:
        assert isinstance(make().init(params), state)
    tx = ftopt.multi_transform({"a": ftopt.sgd(0.1)}, {"w": "a"})
    assert isinstance(tx.init(params), ftopt.MultiTransformState)
    assert isinstance(ftopt.apply_every(2).init(params), ftopt.ApplyEvery)
    built = ftopt.GradientTransformationExtraArgs(*ftopt.sgd(0.1))
    assert isinstance(built, ftopt.GradientTransformation)


def test_contrib_holds_optax_contrib_s_names_as_the_top_level_s_objects():
    names = set(CONTRIB) | {"MuonDimensionNumbers"}
    assert set(ftopt.contrib.__all__) == names
    differ = [n for n in names if getattr(ftopt.contrib, n) is not getattr(ftopt, n)]
    assert not differ, differ


def test_tree_utils_holds_ftopt_tree_s_functions_under_optax_s_older_names():
    assert set(ftopt.tree_utils.__all__) == set(TREE_UTILS)
    for name in TREE_UTILS:
        plain = name.removeprefix("tree_")
        assert getattr(ftopt.tree_utils, name) is getattr(ftopt.tree, plain), name
    for name in ["bias_correction", "update_moment", "update_infinity_moment",
                 "update_moment_per_elem_norm"]:
        assert getattr(ftopt, name) is getattr(ftopt.tree, name), name
    assert ftopt.tree_map_params is ftopt.tree.map_params


def test_losses_holds_optax_losses_names_and_the_top_level_names_them_too():
    assert set(ftopt.losses.__all__) == set(LOSSES)
    top = [n for n in OPTAX if n in LOSSES]
    assert len(top) == 19
    differ = [n for n in top if getattr(ftopt, n) is not getattr(ftopt.losses, n)]
    assert not differ, differ


def test_transforms_and_schedules_hold_optax_s_names_there():
    """``optax.transforms.masked``, ``optax.schedules.inject_hyperparams``: the same objects
    as ftopt's top level, and listed in the subpackages' ``__all__``."""
    for package, names in ((ftopt.transforms, TRANSFORMS), (ftopt.schedules, SCHEDULES)):
        missing = [n for n in names if n not in package.__all__ or not hasattr(package, n)]
        assert not missing, (package.__name__, missing)
        differ = [n for n in names if hasattr(ftopt, n)
                  and getattr(package, n) is not getattr(ftopt, n)]
        assert not differ, (package.__name__, differ)
    schedule = ftopt.schedules.inject_hyperparams(ftopt.sgd)(learning_rate=0.1)
    params = {"w": torch.ones(3)}
    assert isinstance(schedule.init(params), ftopt.schedules.InjectHyperparamsState)
