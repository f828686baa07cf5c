//! The Kubernetes manifests in `deploy/kubernetes/` against the router that will read them:
//! the ConfigMap's `router.yaml` loads and builds its scheduler, and each engine Deployment's pod
//! template, once scheduled and Ready, is discovered as an endpoint with the ports the router
//! needs (the schema check in `scripts/check-manifests.sh` cannot see either).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Pod;
use kvmesh_router::RouterConfig;
use kvmesh_router::config::{DiscoveryConfig, KubernetesDiscovery, Role};
use kvmesh_router::discovery::kubernetes::pod_endpoint;
use serde_json::{Value, json};

fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// Every YAML document of a manifest file, as JSON values.
fn documents(rel: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo_file(rel)).unwrap();
    text.split("\n---")
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
        })
        .map(|d| serde_norway::from_str::<Value>(d).unwrap())
        .collect()
}

fn router_config() -> (RouterConfig, tempfile::TempDir) {
    let cm = documents("deploy/kubernetes/router/configmap.yaml")
        .into_iter()
        .find(|d| d["kind"] == "ConfigMap")
        .expect("a ConfigMap");
    let yaml = cm["data"]["router.yaml"].as_str().expect("router.yaml key");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("router.yaml");
    std::fs::write(&path, yaml).unwrap();
    let cfg = RouterConfig::load(&path).expect("the ConfigMap's router.yaml loads and validates");
    (cfg, dir)
}

fn kubernetes_discovery(cfg: &RouterConfig) -> KubernetesDiscovery {
    match &cfg.discovery {
        Some(DiscoveryConfig::Kubernetes(k)) => k.clone(),
        other => panic!("the router manifest should watch pods, got {other:?}"),
    }
}

#[test]
fn the_configmap_router_yaml_loads_and_builds_its_scheduler() {
    let (cfg, _dir) = router_config();
    let cost_model = kvmesh_sched::cost_model::CostModel::new(cfg.cost_model.clone());
    kvmesh_sched::Scheduler::build(
        &cfg.plugins,
        &cfg.scheduling_profiles,
        cfg.default_profile.as_deref(),
        cfg.seed,
        &std::sync::Arc::new(cost_model),
    )
    .expect("plugins and profiles of the ConfigMap build");
    let k = kubernetes_discovery(&cfg);
    assert_eq!(k.namespace.as_deref(), Some("kvmesh"));
}

/// The pod a Deployment's template becomes once scheduled at `ip` and Ready.
fn scheduled_pod(deployment: &Value, ip: &str) -> Pod {
    let template = &deployment["spec"]["template"];
    let mut metadata = template["metadata"].clone();
    metadata["name"] = json!(format!(
        "{}-7d9f8-abcde",
        deployment["metadata"]["name"].as_str().unwrap()
    ));
    metadata["namespace"] = deployment["metadata"]["namespace"].clone();
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": template["spec"],
        "status": {"podIP": ip, "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .expect("the pod template is a valid Pod")
}

/// `key=value[,key=value]` equality selectors (what the manifests use) against pod labels.
fn selector_matches(selector: &str, labels: &Value) -> bool {
    selector.split(',').all(|term| {
        let (k, v) = term.split_once('=').expect("equality selector");
        labels[k.trim()].as_str() == Some(v.trim())
    })
}

#[test]
fn engine_deployments_are_discovered_with_http_p2p_and_events() {
    let (cfg, _dir) = router_config();
    let k = kubernetes_discovery(&cfg);
    // The vLLM pods carry a KV group, the sim fleet none: the router never asks one to pull
    // from the other.
    for (file, want_p2p, want_group) in [
        ("deploy/kubernetes/sim-fleet/deployment.yaml", true, None),
        (
            "deploy/kubernetes/vllm/deployment.yaml",
            true,
            Some("vllm-qwen2.5-1.5b-bs32"),
        ),
    ] {
        let deployment = documents(file)
            .into_iter()
            .find(|d| d["kind"] == "Deployment")
            .expect("a Deployment");
        assert_eq!(
            deployment["metadata"]["namespace"],
            json!(k.namespace.as_deref().unwrap()),
            "{file}: engines live where the router watches"
        );
        assert!(
            selector_matches(
                &k.label_selector,
                &deployment["spec"]["template"]["metadata"]["labels"]
            ),
            "{file}: pod labels must match the router's selector {}",
            k.label_selector
        );
        let pod = scheduled_pod(&deployment, "10.244.1.7");
        let found = pod_endpoint(&pod, &k).unwrap_or_else(|e| panic!("{file}: skipped: {e:?}"));
        assert!(found.ready, "{file}");
        assert_eq!(found.spec.role, Role::Both, "{file}");
        assert_eq!(found.spec.kv_group(), want_group, "{file}");
        assert!(
            found.spec.url.starts_with("http://10.244.1.7:"),
            "{file}: {}",
            found.spec.url
        );
        assert_eq!(
            found.spec.p2p.is_some(),
            want_p2p,
            "{file}: {:?}",
            found.spec
        );
        let events = found.spec.kv_events.as_ref().expect("KV events port");
        assert!(
            format!("{events:?}").contains("10.244.1.7"),
            "{file}: {events:?}"
        );
    }
}
