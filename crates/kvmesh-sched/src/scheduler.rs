//! The scheduling pipeline: per profile, filters → weighted scorers → picker → P2P source.
//!
//! A [`Profile`] is built from config (llm-d `scheduling_profiles`); [`Profile::schedule`] is pure
//! (candidates in, [`Decision`] out, randomness injected) so it is unit-tested without I/O. The
//! [`Decision`] carries everything `/debug/decisions` explains: per-candidate inputs, per-plugin
//! scores, filter notes, the chosen endpoint and the P2P outcome.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use kvmesh_index::EndpointId;

use crate::candidate::{Candidate, SchedulingContext};
use crate::config::{PluginSpec, ProfileSpec};
use crate::cost_model::CostModel;
use crate::plugin::{Filter, Picker, Scorer};
use crate::plugins::p2p_source_producer::{P2pDecision, P2pSourceProducer};
use crate::plugins::{BuiltPlugin, Plugin, PluginError, build_plugin, max_score_picker};
use crate::predict::Prediction;

/// A named scheduling profile.
pub struct Profile {
    pub name: String,
    filters: Vec<(String, Arc<dyn Filter>)>,
    scorers: Vec<(String, Arc<dyn Scorer>, f64)>,
    picker: (String, Arc<dyn Picker>),
    p2p: Option<(String, Arc<P2pSourceProducer>)>,
    /// The scorer (index into `scorers`) whose predictions price pulls, when there is one: the
    /// P2P step of `mode: predicted` carries out its price.
    pricing: Option<usize>,
    /// The profile as plain data (see [`ProfileShape`]).
    shape: ProfileShape,
}

/// A built profile as plain data, defaults filled in: what two configs that must place alike
/// are compared by (a test keeps `configs/router.yaml`, the router's built-in default and the
/// bench's default arm equal this way).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileShape {
    pub name: String,
    pub steps: Vec<StepShape>,
}

/// One plugin of a profile, in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepShape {
    /// The reference name (`/debug/decisions` names scores by it).
    pub name: String,
    /// The plugin type.
    pub kind: String,
    /// For scorers.
    pub weight: Option<f64>,
    /// The typed parameters it runs with, serialized back.
    pub parameters: serde_json::Value,
}

/// One candidate as `/debug/decisions` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateReport {
    pub endpoint: String,
    pub gpu_tokens: u64,
    pub cpu_tokens: u64,
    pub any_tokens: u64,
    pub in_flight_requests: u64,
    pub in_flight_uncached_tokens: u64,
    /// What in-flight requests need the GPU tier to hold (distinct prompt + decode tokens).
    pub in_flight_context_tokens: u64,
    /// This request's prompt tokens in-flight requests already hold (0 without a known capacity).
    pub in_flight_shared_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_capacity_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_ms: Option<f64>,
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
    /// Survived every filter.
    pub kept: bool,
    /// Per scorer (plugin name → unweighted score), for kept candidates.
    pub scores: BTreeMap<String, f64>,
    /// Σ weight × score.
    pub total: Option<f64>,
    /// Pulls in flight into / out of the endpoint (named by this router).
    pub pulls_in: u64,
    pub pulls_out: u64,
    /// Of `pulls_in`, those expected to be still in transfer (what `delays_pulling_ms` counts).
    pub pulls_landing_in: u64,
    /// The prompt tokens their requests compute once landed.
    pub pulls_landing_uncached_tokens: u64,
    /// The endpoint's KV group, when it has one (pull sources are chosen within it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_group: Option<String>,
    /// The predicted time to first token, when the profile has a scorer that predicts it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Prediction>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FilterReport {
    pub plugin: String,
    pub kept: usize,
    pub note: String,
}

/// Everything about one scheduling decision.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    pub profile: String,
    /// The chosen endpoint (its name is `endpoint`).
    #[serde(skip)]
    pub chosen: Option<EndpointId>,
    pub endpoint: Option<String>,
    pub picker: String,
    pub filters: Vec<FilterReport>,
    pub candidates: Vec<CandidateReport>,
    /// Present when the profile has a P2P plugin and an endpoint was chosen.
    pub p2p: Option<P2pDecision>,
}

impl Decision {
    /// The P2P source, if one was named.
    pub fn p2p_source(&self) -> Option<EndpointId> {
        self.p2p.as_ref().and_then(|p| p.source)
    }

    /// The chosen endpoint's entry among the candidates the decision was made over.
    pub fn chosen_candidate<'a>(&self, candidates: &'a [Candidate]) -> Option<&'a Candidate> {
        let id = self.chosen?;
        candidates.iter().find(|c| c.endpoint == id)
    }
}

impl Profile {
    /// Builds a profile from its spec and the named plugins. A profile without a picker gets a
    /// `max-score-picker`; one with two pickers or two P2P plugins is rejected.
    pub fn build(
        spec: &ProfileSpec,
        plugins: &HashMap<String, BuiltPlugin>,
    ) -> Result<Profile, PluginError> {
        let invalid = |message: String| PluginError::Invalid {
            name: spec.name.clone(),
            kind: "profile",
            message,
        };
        let mut filters = Vec::new();
        let mut scorers = Vec::new();
        let mut picker: Option<(String, Arc<dyn Picker>)> = None;
        let mut p2p = None;
        let mut pricing = None;
        let mut steps = Vec::with_capacity(spec.plugins.len());
        for r in &spec.plugins {
            let built = plugins
                .get(&r.plugin_ref)
                .ok_or_else(|| invalid(format!("unknown plugin_ref {:?}", r.plugin_ref)))?;
            let mut weight = None;
            match &built.plugin {
                Plugin::Filter(f) => filters.push((r.plugin_ref.clone(), Arc::clone(f))),
                Plugin::Scorer(s) => {
                    let w = r.weight.unwrap_or(1.0);
                    if !w.is_finite() || w < 0.0 {
                        return Err(invalid(format!(
                            "weight of {:?} must be a finite number >= 0",
                            r.plugin_ref
                        )));
                    }
                    if s.prices_pulls() && pricing.replace(scorers.len()).is_some() {
                        return Err(invalid(
                            "more than one scorer prices pulls (predicted-ttft-scorer with p2p: \
                             true)"
                                .to_owned(),
                        ));
                    }
                    weight = Some(w);
                    scorers.push((r.plugin_ref.clone(), Arc::clone(s), w));
                }
                Plugin::Picker(p) => {
                    if picker
                        .replace((r.plugin_ref.clone(), Arc::clone(p)))
                        .is_some()
                    {
                        return Err(invalid("more than one picker".to_owned()));
                    }
                }
                Plugin::P2pSource(p) => {
                    if p2p.replace((r.plugin_ref.clone(), Arc::clone(p))).is_some() {
                        return Err(invalid("more than one p2p-source-producer".to_owned()));
                    }
                }
            }
            steps.push(StepShape {
                name: r.plugin_ref.clone(),
                kind: built.plugin.type_name().to_owned(),
                weight,
                parameters: built.parameters.clone(),
            });
        }
        if let Some((name, p)) = &p2p
            && p.needs_prediction()
            && pricing.is_none()
        {
            return Err(invalid(format!(
                "{name:?} (mode: predicted) carries out the placement's pull price, but no \
                 scorer of the profile prices pulls: add a predicted-ttft-scorer with p2p: true"
            )));
        }
        let picker = picker.unwrap_or_else(|| {
            (
                max_score_picker::TYPE.to_owned(),
                Arc::new(max_score_picker::MaxScorePicker) as Arc<dyn Picker>,
            )
        });
        Ok(Profile {
            name: spec.name.clone(),
            filters,
            scorers,
            picker,
            p2p,
            pricing,
            shape: ProfileShape {
                name: spec.name.clone(),
                steps,
            },
        })
    }

    /// The profile as plain data.
    pub fn shape(&self) -> &ProfileShape {
        &self.shape
    }

    pub fn has_p2p(&self) -> bool {
        self.p2p.is_some()
    }

    /// Runs only the profile's P2P source selection over `candidates` with `computing` (one of
    /// them) as the computing endpoint (P/D: a prefill pick, sources among prefill and decode
    /// endpoints). None when the profile has no P2P plugin or `computing` is not a candidate.
    pub fn select_source(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[Candidate],
        computing: EndpointId,
    ) -> Option<P2pDecision> {
        let (_, p) = self.p2p.as_ref()?;
        let at = candidates.iter().position(|c| c.endpoint == computing)?;
        let all: Vec<&Candidate> = candidates.iter().collect();
        // No placement ran over these candidates: the pricing scorer predicts for `computing`.
        let placement = match self.pricing.and_then(|i| self.scorers.get(i)) {
            Some((_, s, _)) if p.needs_prediction() => s.score_explained(ctx, &all).1,
            _ => None,
        };
        let placement = placement.as_ref().and_then(|p| p.get(at));
        Some(p.select(ctx, &all, at, placement))
    }

    /// Runs the pipeline over `candidates` (healthy endpoints able to serve the request).
    pub fn schedule(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> Decision {
        let bs = ctx.block_size as u64;
        let mut reports: Vec<CandidateReport> = candidates
            .iter()
            .map(|c| CandidateReport {
                endpoint: c.name.to_string(),
                gpu_tokens: c.gpu_blocks as u64 * bs,
                cpu_tokens: c.cpu_blocks as u64 * bs,
                any_tokens: c.any_blocks as u64 * bs,
                in_flight_requests: c.in_flight_requests,
                in_flight_uncached_tokens: c.in_flight_uncached_tokens,
                in_flight_context_tokens: c.in_flight_context_tokens,
                in_flight_shared_tokens: c.in_flight_shared_tokens,
                gpu_capacity_tokens: c.gpu_capacity_tokens,
                decode_ms: c.decode_ms,
                waiting: c.waiting,
                running: c.running,
                kv_usage: c.kv_usage,
                kept: false,
                scores: BTreeMap::new(),
                total: None,
                pulls_in: c.pulls_in,
                pulls_out: c.pulls_out,
                pulls_landing_in: c.pulls_landing_in,
                pulls_landing_uncached_tokens: c.pulls_landing_uncached_tokens,
                kv_group: c.kv_group.as_deref().map(str::to_owned),
                predicted: None,
            })
            .collect();
        // `alive` maps positions of the filtered list back to `candidates`.
        let mut alive: Vec<usize> = (0..candidates.len()).collect();
        let mut filter_reports = Vec::with_capacity(self.filters.len());
        for (name, f) in &self.filters {
            if alive.is_empty() {
                break;
            }
            let refs: Vec<&Candidate> = alive.iter().map(|&i| &candidates[i]).collect();
            let out = f.filter(ctx, &refs, rng);
            let mut kept: Vec<usize> = out
                .kept
                .iter()
                .filter_map(|&k| alive.get(k).copied())
                .collect();
            kept.dedup();
            // A filter that drops everyone is ignored: better any endpoint than a failed request.
            if !kept.is_empty() {
                alive = kept;
            }
            filter_reports.push(FilterReport {
                plugin: name.clone(),
                kept: alive.len(),
                note: out.note,
            });
        }
        let refs: Vec<&Candidate> = alive.iter().map(|&i| &candidates[i]).collect();
        let mut totals = vec![0.0; refs.len()];
        for (k, (name, s, w)) in self.scorers.iter().enumerate() {
            let (scores, predictions) = s.score_explained(ctx, &refs);
            let predictions = predictions.unwrap_or_default();
            for (j, &i) in alive.iter().enumerate() {
                // The pricing scorer's prediction is the one the P2P step carries out.
                if let Some(p) = predictions.get(j)
                    && (self.pricing.is_none() || self.pricing == Some(k))
                {
                    reports[i].predicted = Some(p.clone());
                }
                let v = scores.get(j).copied().unwrap_or(0.0);
                let v = if v.is_finite() { v } else { 0.0 };
                reports[i].scores.insert(name.clone(), v);
                totals[j] += w * v;
            }
        }
        for (k, &i) in alive.iter().enumerate() {
            reports[i].kept = true;
            reports[i].total = Some(totals[k]);
        }
        let chosen = self
            .picker
            .1
            .pick(ctx, &refs, &totals, rng)
            .and_then(|k| alive.get(k).copied());
        let p2p = match (&self.p2p, chosen) {
            (Some((_, p)), Some(c)) => {
                let all: Vec<&Candidate> = candidates.iter().collect();
                Some(p.select(ctx, &all, c, reports[c].predicted.as_ref()))
            }
            _ => None,
        };
        Decision {
            profile: self.name.clone(),
            chosen: chosen.map(|i| candidates[i].endpoint),
            endpoint: chosen.map(|i| candidates[i].name.to_string()),
            picker: self.picker.0.clone(),
            filters: filter_reports,
            candidates: reports,
            p2p,
        }
    }
}

/// All profiles of a config, the default one, and the seeded rng every plugin draws from.
pub struct Scheduler {
    profiles: Vec<Arc<Profile>>,
    default: usize,
    rng: Mutex<ChaCha8Rng>,
}

impl Scheduler {
    /// Builds plugins and profiles (at least one; the router fills in its default placement,
    /// `configs/router.yaml`, for a config without any).
    pub fn build(
        plugins: &[PluginSpec],
        profiles: &[ProfileSpec],
        default_profile: Option<&str>,
        seed: Option<u64>,
        cost_model: &Arc<CostModel>,
    ) -> Result<Scheduler, PluginError> {
        if profiles.is_empty() {
            return Err(PluginError::Invalid {
                name: "scheduling_profiles".to_owned(),
                kind: "profiles",
                message: "no scheduling profile".to_owned(),
            });
        }
        let mut built = HashMap::new();
        for p in plugins {
            let name = p.name.clone().unwrap_or_else(|| p.kind.clone());
            let plugin = build_plugin(&p.kind, &name, &p.parameters, cost_model)?;
            if built.insert(name.clone(), plugin).is_some() {
                return Err(PluginError::Invalid {
                    name,
                    kind: "plugins",
                    message: "duplicate plugin name".to_owned(),
                });
            }
        }
        let profiles: Vec<Arc<Profile>> = profiles
            .iter()
            .map(|s| Profile::build(s, &built).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let default = match default_profile {
            Some(name) => profiles
                .iter()
                .position(|p| p.name == name)
                .ok_or_else(|| PluginError::Invalid {
                    name: name.to_owned(),
                    kind: "default_profile",
                    message: "no such profile".to_owned(),
                })?,
            None => 0,
        };
        let rng = match seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_os_rng(),
        };
        Ok(Scheduler {
            profiles,
            default,
            rng: Mutex::new(rng),
        })
    }

    pub fn profile(&self, name: Option<&str>) -> Option<Arc<Profile>> {
        match name {
            None => self.profiles.get(self.default).cloned(),
            Some(n) => self.profiles.iter().find(|p| p.name == n).cloned(),
        }
    }

    pub fn profile_names(&self) -> Vec<String> {
        self.profiles.iter().map(|p| p.name.clone()).collect()
    }

    /// Every profile as plain data (the default one first).
    pub fn shape(&self) -> Vec<ProfileShape> {
        let default = self.profiles.get(self.default).map(|p| p.shape().clone());
        default
            .into_iter()
            .chain(
                (self.profiles.iter().enumerate())
                    .filter(|&(i, _)| i != self.default)
                    .map(|(_, p)| p.shape().clone()),
            )
            .collect()
    }

    /// Schedules with the shared rng (held only for the synchronous pipeline run).
    pub fn schedule(
        &self,
        profile: &Profile,
        ctx: &SchedulingContext<'_>,
        candidates: &[Candidate],
    ) -> Decision {
        let mut rng = self.rng.lock();
        profile.schedule(ctx, candidates, &mut *rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PluginRef;

    /// The scheduling part of a router YAML.
    #[derive(serde::Deserialize)]
    struct RouterConfig {
        #[serde(default)]
        plugins: Vec<PluginSpec>,
        #[serde(default)]
        scheduling_profiles: Vec<ProfileSpec>,
    }
    use crate::cost_model::CostModelParams;
    use crate::plugins::test_util::{ctx, rng};

    fn scheduler(yaml: &str) -> Scheduler {
        let cfg: RouterConfig = serde_norway::from_str(yaml).expect("yaml");
        let cm = Arc::new(CostModel::new(CostModelParams::default()));
        Scheduler::build(&cfg.plugins, &cfg.scheduling_profiles, None, Some(1), &cm).expect("build")
    }

    const AFFINITY: &str = r#"
plugins:
  - {type: prefix-cache-scorer, name: prefix}
  - {type: queue-scorer, name: queue, parameters: {queue_source: waiting}}
  - {type: kv-cache-utilization-scorer, name: kvu}
  - {type: max-score-picker}
scheduling_profiles:
  - name: affinity
    plugins:
      - {plugin_ref: prefix, weight: 3}
      - {plugin_ref: queue, weight: 2}
      - {plugin_ref: kvu, weight: 2}
      - {plugin_ref: max-score-picker}
"#;

    #[test]
    fn weighted_sum_of_scores_picks_the_holder() {
        let s = scheduler(AFFINITY);
        let p = s.profile(None).expect("default");
        // 10 blocks. A: holds 10, waiting 4, kv 0.5 → 3·1 + 2·0 + 2·0.5 = 4.0.
        // B: holds 0, waiting 0, kv 0 → 0 + 2 + 2 = 4.0 − ... make B kv 0.1 → 3.8.
        let mut a = Candidate::idle(0, "a");
        (a.gpu_blocks, a.any_blocks, a.waiting, a.kv_usage) = (10, 10, Some(4.0), Some(0.5));
        let mut b = Candidate::idle(1, "b");
        (b.waiting, b.kv_usage) = (Some(0.0), Some(0.1));
        let d = p.schedule(&ctx(160, 16), &[a, b], &mut rng(1));
        assert_eq!(d.endpoint.as_deref(), Some("a"));
        assert!((d.candidates[0].total.expect("kept") - 4.0).abs() < 1e-12);
        assert!((d.candidates[1].total.expect("kept") - 3.8).abs() < 1e-12);
        assert_eq!(d.candidates[0].scores["prefix"], 1.0);
        assert!(d.p2p.is_none());
    }

    #[test]
    fn load_p2p_profile_names_the_holder() {
        let s = scheduler(
            r#"
plugins:
  - {type: queue-scorer, name: queue}
  - {type: kv-cache-utilization-scorer, name: kvu}
  - {type: weighted-random-picker, name: picker}
  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 64}}
scheduling_profiles:
  - name: load-p2p
    plugins: [{plugin_ref: queue, weight: 3}, {plugin_ref: kvu, weight: 2}, {plugin_ref: picker}, {plugin_ref: p2p}]
"#,
        );
        let p = s.profile(Some("load-p2p")).expect("profile");
        // A holds the whole prompt in CPU and is saturated (total score 0); idle B is chosen, A named as source.
        let mut a = Candidate::idle(0, "a");
        (
            a.gpu_blocks,
            a.cpu_blocks,
            a.any_blocks,
            a.in_flight_requests,
            a.kv_usage,
        ) = (10, 10, 10, 5, Some(1.0));
        let b = Candidate::idle(1, "b");
        let d = p.schedule(&ctx(160, 16), &[a, b], &mut rng(1));
        assert_eq!(d.endpoint.as_deref(), Some("b"));
        let p2p = d.p2p.as_ref().expect("ran");
        assert_eq!(p2p.source_endpoint.as_deref(), Some("a"));
        assert_eq!(d.p2p_source(), Some(EndpointId(0)));
    }

    #[test]
    fn filter_restricts_candidates_and_is_reported() {
        let s = scheduler(
            r#"
plugins:
  - {type: prefix-cache-affinity-filter, name: sticky}
  - {type: queue-scorer, name: queue}
scheduling_profiles:
  - name: p
    plugins: [{plugin_ref: sticky}, {plugin_ref: queue}]
"#,
        );
        let p = s.profile(None).expect("default");
        let mut a = Candidate::idle(0, "a");
        (a.gpu_blocks, a.any_blocks, a.in_flight_requests) = (10, 10, 3);
        let b = Candidate::idle(1, "b");
        let d = p.schedule(&ctx(160, 16), &[a, b], &mut rng(1));
        assert_eq!(d.endpoint.as_deref(), Some("a"));
        assert!(!d.candidates[1].kept);
        assert_eq!(d.filters[0].kept, 1);
    }

    #[test]
    fn bad_configs_are_rejected() {
        let cm = Arc::new(CostModel::new(CostModelParams::default()));
        let unknown = vec![PluginSpec {
            kind: "nope".into(),
            name: None,
            parameters: None,
        }];
        let prof = vec![ProfileSpec {
            name: "p".into(),
            plugins: vec![],
        }];
        assert!(Scheduler::build(&unknown, &prof, None, Some(1), &cm).is_err());
        let prof = vec![ProfileSpec {
            name: "p".into(),
            plugins: vec![PluginRef {
                plugin_ref: "missing".into(),
                weight: None,
            }],
        }];
        assert!(Scheduler::build(&[], &prof, None, Some(1), &cm).is_err());
        let cfg: RouterConfig = serde_norway::from_str(AFFINITY).expect("yaml");
        assert!(
            Scheduler::build(
                &cfg.plugins,
                &cfg.scheduling_profiles,
                Some("nope"),
                Some(1),
                &cm
            )
            .is_err()
        );
    }

    #[test]
    fn a_config_without_profiles_is_refused_here() {
        // The router fills in its default placement (configs/router.yaml) before it builds.
        let cm = Arc::new(CostModel::new(CostModelParams::default()));
        assert!(Scheduler::build(&[], &[], None, Some(1), &cm).is_err());
    }

    const TTFT_P2P: &str = r#"
plugins:
  - {type: predicted-ttft-scorer, name: ttft, parameters: {p2p: true, min_pull_tokens: 512}}
  - {type: p2p-source-producer, name: p2p, parameters: {mode: predicted}}
scheduling_profiles:
  - name: ttft-p2p
    plugins: [{plugin_ref: ttft}, {plugin_ref: p2p}]
"#;

    #[test]
    fn the_p2p_step_carries_out_the_placements_pull_price() {
        let s = scheduler(TTFT_P2P);
        let p = s.profile(None).expect("default");
        // A holds 16K tokens in its CPU tier and a long prefill queue; B is idle and cold.
        let mut a = Candidate::idle(0, "a");
        (a.cpu_blocks, a.any_blocks) = (1024, 1024);
        (a.in_flight_requests, a.in_flight_uncached_tokens) = (1, 50_000);
        let b = Candidate::idle(1, "b");
        let prompt = ctx(16_384 + 256, 16);
        let d = p.schedule(&prompt, &[a.clone(), b.clone()], &mut rng(1));
        assert_eq!(d.endpoint.as_deref(), Some("b"));
        let pred = d.candidates[1].predicted.clone().expect("predicted");
        let plan = pred.best_pull.expect("a pull option");
        let p2p = d.p2p.as_ref().expect("ran");
        assert_eq!(p2p.source, Some(EndpointId(0)));
        assert_eq!(p2p.predicted_pull_ms, Some(plan.pull_ms));
        // A request that may not pull: placement prices no pull and the step names none.
        let held = SchedulingContext {
            may_pull: false,
            ..prompt
        };
        let d = p.schedule(&held, &[a.clone(), b.clone()], &mut rng(1));
        let pred = d.candidates[1].predicted.clone().expect("predicted");
        assert!(pred.best_pull.is_none() && !pred.pulls);
        let p2p = d.p2p.as_ref().expect("ran");
        assert_eq!(p2p.source, None);
        // P/D: the source over other candidates is priced by the same scorer.
        let named = p
            .select_source(&prompt, &[a, b], EndpointId(1))
            .expect("ran");
        assert_eq!(named.source, Some(EndpointId(0)));
    }

    #[test]
    fn predicted_pulls_need_a_scorer_that_prices_them() {
        let cm = Arc::new(CostModel::new(CostModelParams::default()));
        let build = |yaml: &str| {
            let cfg: RouterConfig = serde_norway::from_str(yaml).expect("yaml");
            Scheduler::build(&cfg.plugins, &cfg.scheduling_profiles, None, Some(1), &cm)
        };
        assert!(build(TTFT_P2P).is_ok());
        let no_pulls = TTFT_P2P.replace("p2p: true", "p2p: false");
        let err = build(&no_pulls).err().expect("refused").to_string();
        assert!(
            err.contains("predicted-ttft-scorer with p2p: true"),
            "{err}"
        );
        let no_scorer = TTFT_P2P.replace("{plugin_ref: ttft}, ", "");
        assert!(build(&no_scorer).is_err());
    }

    #[test]
    fn shapes_compare_parameters_with_defaults_filled_in() {
        let explicit = TTFT_P2P.replace(
            "min_pull_tokens: 512",
            "min_pull_tokens: 512, work_weight: 2",
        );
        let s = scheduler(TTFT_P2P);
        assert_eq!(s.shape(), scheduler(&explicit).shape());
        let other = TTFT_P2P.replace("min_pull_tokens: 512", "min_pull_tokens: 1024");
        assert_ne!(s.shape(), scheduler(&other).shape());
        let shape = &s.shape()[0];
        assert_eq!(shape.steps[0].parameters["work_weight"], 2.0);
    }
}
