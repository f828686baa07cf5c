//! One pass that renames a config's deprecated keys before it is read. Every key of a kvmesh YAML
//! is snake_case; the spellings accepted before — llm-d's camelCase for plugin parameters,
//! `schedulingProfiles` and `pluginRef`, and the admission queue's old key `dispatch` — stay
//! accepted for one release, renamed here, each reported once.

use kvmesh_sched::config::DEPRECATED_PARAMETER_KEYS;
use serde_norway::{Mapping, Value};

/// Top-level keys that were renamed.
const DEPRECATED_TOP_LEVEL_KEYS: &[(&str, &str)] = &[
    ("schedulingProfiles", "scheduling_profiles"),
    ("dispatch", "admission_queue"),
];

/// Keys of a profile's plugin reference that were renamed.
const DEPRECATED_REFERENCE_KEYS: &[(&str, &str)] = &[("pluginRef", "plugin_ref")];

/// Renames the deprecated keys of a router config document in place: at the top level, in each
/// plugin's `parameters`, and in each profile's plugin references (nowhere else: other maps may
/// hold names of the user's). Returns each `(old, new)` found once, in order, or why the
/// document is ambiguous (one key in both spellings).
pub fn rename_deprecated_keys(
    doc: &mut Value,
) -> Result<Vec<(&'static str, &'static str)>, String> {
    let mut found = Vec::new();
    let Some(top) = doc.as_mapping_mut() else {
        return Ok(found);
    };
    rename(top, DEPRECATED_TOP_LEVEL_KEYS, &mut found)?;
    if let Some(Value::Sequence(plugins)) = top.get_mut("plugins") {
        for params in plugins.iter_mut().filter_map(|p| p.get_mut("parameters")) {
            if let Some(params) = params.as_mapping_mut() {
                rename(params, DEPRECATED_PARAMETER_KEYS, &mut found)?;
            }
        }
    }
    if let Some(Value::Sequence(profiles)) = top.get_mut("scheduling_profiles") {
        for refs in profiles.iter_mut().filter_map(|p| p.get_mut("plugins")) {
            for r in refs.as_sequence_mut().into_iter().flatten() {
                if let Some(r) = r.as_mapping_mut() {
                    rename(r, DEPRECATED_REFERENCE_KEYS, &mut found)?;
                }
            }
        }
    }
    Ok(found)
}

fn rename(
    map: &mut Mapping,
    table: &[(&'static str, &'static str)],
    found: &mut Vec<(&'static str, &'static str)>,
) -> Result<(), String> {
    for &(old, new) in table {
        let Some(value) = map.remove(old) else {
            continue;
        };
        if map.contains_key(new) {
            return Err(format!(
                "both `{old}` (the deprecated spelling) and `{new}` are given"
            ));
        }
        map.insert(Value::String(new.to_owned()), value);
        if !found.contains(&(old, new)) {
            found.push((old, new));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn renamed(yaml: &str) -> (Value, Vec<(&'static str, &'static str)>) {
        let mut doc: Value = serde_norway::from_str(yaml).expect("yaml");
        let found = rename_deprecated_keys(&mut doc).expect("renamed");
        (doc, found)
    }

    #[test]
    fn old_spellings_become_the_snake_case_keys_once_each() {
        let (doc, found) = renamed(
            "dispatch: {max_hold: 1s}
plugins:
  - {type: predicted-ttft-scorer, parameters: {minPullTokens: 64, workWeight: 1}}
  - {type: p2p-source-producer, parameters: {minCachedTokenDelta: 64, marginMs: 5}}
  - {type: prefix-cache-scorer, parameters: {scaleTokens: 8, gpuWeight: 1}}
schedulingProfiles:
  - {name: a, plugins: [{pluginRef: p}, {pluginRef: q, weight: 2}]}
",
        );
        let new: Value = serde_norway::from_str(
            "admission_queue: {max_hold: 1s}
plugins:
  - {type: predicted-ttft-scorer, parameters: {min_pull_tokens: 64, work_weight: 1}}
  - {type: p2p-source-producer, parameters: {min_cached_token_delta: 64, margin_ms: 5}}
  - {type: prefix-cache-scorer, parameters: {scale_tokens: 8, gpu_weight: 1}}
scheduling_profiles:
  - {name: a, plugins: [{plugin_ref: p}, {plugin_ref: q, weight: 2}]}
",
        )
        .expect("yaml");
        assert_eq!(doc, new);
        let old: Vec<&str> = found.iter().map(|(o, _)| *o).collect();
        assert_eq!(
            old,
            [
                "schedulingProfiles",
                "dispatch",
                "minPullTokens",
                "workWeight",
                "marginMs",
                "minCachedTokenDelta",
                "gpuWeight",
                "scaleTokens",
                "pluginRef"
            ],
            "each key once, however often it appears"
        );
        // The new spelling needs no renaming.
        assert!(
            renamed(&serde_norway::to_string(&new).expect("yaml"))
                .1
                .is_empty()
        );
    }

    #[test]
    fn only_config_keys_are_renamed_and_a_key_in_both_spellings_is_refused() {
        // A camelCase word elsewhere (an endpoint's name, a profile's name) is the user's.
        let yaml = "endpoints: [{name: minPullTokens, url: \"http://x:1\"}]\nplugins: []";
        assert!(renamed(yaml).1.is_empty());
        let mut both: Value =
            serde_norway::from_str("dispatch: {}\nadmission_queue: {}").expect("yaml");
        let err = rename_deprecated_keys(&mut both).expect_err("ambiguous");
        assert!(err.contains("`dispatch`"), "{err}");
    }
}
