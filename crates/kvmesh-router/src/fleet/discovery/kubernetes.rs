//! `discovery: {kind: kubernetes}`: engine pods watched through the Kubernetes API (kube-rs's
//! `watcher`: list, then watch from the list's resourceVersion with bookmarks; a 410 Gone starts
//! over with a fresh list).
//!
//! A pod is an endpoint named `<namespace>/<pod>` at its `status.podIP`, ports from its
//! containers' named ports (`ports:` in the config) unless the `kvmesh.dev/*-port` annotations
//! say otherwise, role from the `kvmesh.dev/role` annotation, then label, then the config. A pod
//! whose Ready condition is not True (or that is terminating) stays in the list, index entries
//! and all, but is not placeable. A pod without an IP or an HTTP port is skipped, logged and
//! counted once. Pod → endpoint and the pod set → list are pure ([`pod_endpoint`], [`PodSet`]).

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use super::shared::{DiscoveryError, Ports, Sink, failed, skipped, spec_at};
use crate::config::{KubernetesDiscovery, Role};
use crate::fleet::endpoints::Discovered;
use crate::metrics::{Kind, RouterMetrics};

/// Annotation (or label) naming a pod's role: `prefill`, `decode` or `both`.
pub const ROLE_KEY: &str = "kvmesh.dev/role";
/// Annotation (or label) naming a pod's KV group (`EndpointSpec::kv_group`): pods whose KV blocks
/// are interchangeable share one, and pulls never cross groups.
pub const KV_GROUP_KEY: &str = "kvmesh.dev/kv-group";
pub const HTTP_PORT_ANNOTATION: &str = "kvmesh.dev/http-port";
pub const P2P_PORT_ANNOTATION: &str = "kvmesh.dev/p2p-port";
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kvmesh.dev/kv-events-port";
pub const KV_REPLAY_PORT_ANNOTATION: &str = "kvmesh.dev/kv-replay-port";

/// Why a pod maps to no endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("no pod IP yet")]
    NoIp,
    #[error("pod IP {0:?} is not an IP address")]
    BadIp(String),
    #[error("no container port named {0:?} and no kvmesh.dev/http-port annotation")]
    NoHttpPort(String),
    #[error("annotation {key}: {value:?} is not a port number")]
    BadPort { key: &'static str, value: String },
    #[error("kvmesh.dev/role {0:?}: expected prefill, decode or both")]
    BadRole(String),
}

/// `<namespace>/<name>`, the endpoint's name and the pod's key in a [`PodSet`].
fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Ready condition True and not being deleted.
fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// The annotation's port if set (an error if it is not a port), else the named container port.
fn port(pod: &Pod, annotation_key: &'static str, name: &str) -> Result<Option<u16>, Skip> {
    if let Some(v) = annotation(pod, annotation_key) {
        return match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(Some(p)),
            _ => Err(Skip::BadPort {
                key: annotation_key,
                value: v.to_owned(),
            }),
        };
    }
    let named = pod
        .spec
        .as_ref()
        .into_iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name))
        .and_then(|p| u16::try_from(p.container_port).ok());
    Ok(named)
}

/// The annotation `key`, else the label `key`.
fn annotation_or_label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    annotation(pod, key).or_else(|| {
        pod.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .map(String::as_str)
    })
}

/// The pod's KV group: annotation, then label, then the config's default; blank means none.
fn kv_group(pod: &Pod, default: Option<&str>) -> Option<String> {
    annotation_or_label(pod, KV_GROUP_KEY)
        .map(str::trim)
        .or(default)
        .filter(|g| !g.is_empty())
        .map(str::to_owned)
}

fn role(pod: &Pod, default: Role) -> Result<Role, Skip> {
    let value = annotation_or_label(pod, ROLE_KEY);
    match value.map(str::trim) {
        None => Ok(default),
        Some("both") => Ok(Role::Both),
        Some("prefill") => Ok(Role::Prefill),
        Some("decode") => Ok(Role::Decode),
        Some(other) => Err(Skip::BadRole(other.to_owned())),
    }
}

/// The endpoint a pod is, with its readiness.
pub fn pod_endpoint(pod: &Pod, cfg: &KubernetesDiscovery) -> Result<Discovered, Skip> {
    let ip_text = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
        .ok_or(Skip::NoIp)?;
    let ip: IpAddr = ip_text
        .parse()
        .map_err(|_| Skip::BadIp(ip_text.to_owned()))?;
    let http = port(pod, HTTP_PORT_ANNOTATION, &cfg.ports.http)?
        .ok_or_else(|| Skip::NoHttpPort(cfg.ports.http.clone()))?;
    let ports = Ports {
        http,
        p2p: port(pod, P2P_PORT_ANNOTATION, &cfg.ports.p2p)?,
        kv_events: port(pod, KV_EVENTS_PORT_ANNOTATION, &cfg.ports.kv_events)?,
        kv_replay: port(pod, KV_REPLAY_PORT_ANNOTATION, &cfg.ports.kv_replay)?,
    };
    let spec = spec_at(
        pod_key(pod),
        ip,
        ports,
        role(pod, cfg.role)?,
        kv_group(pod, cfg.kv_group.as_deref()),
    );
    Ok(Discovered {
        spec,
        ready: is_ready(pod),
    })
}

type Mapped = Result<Discovered, Skip>;

/// The pods the watcher has reported, mapped; rebuilt atomically on every (re-)list.
#[derive(Default)]
pub struct PodSet {
    pods: BTreeMap<String, Mapped>,
    /// Pods of a list in progress (`Init` .. `InitDone`).
    relisting: Option<BTreeMap<String, Mapped>>,
    /// Pods whose skip was already reported, so a pod stuck without an IP is reported once.
    reported: HashSet<String>,
    new_skips: Vec<(String, Skip)>,
}

impl PodSet {
    /// Takes one watcher event; returns whether the endpoint list may have changed.
    fn on_event(&mut self, ev: Event<Pod>, cfg: &KubernetesDiscovery) -> bool {
        match ev {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                let (key, mapped) = self.map(&pod, cfg);
                self.relisting.get_or_insert_default().insert(key, mapped);
                false
            }
            Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                self.reported.retain(|k| listed.contains_key(k));
                self.pods = listed;
                true
            }
            Event::Apply(pod) => {
                let (key, mapped) = self.map(&pod, cfg);
                self.pods.insert(key, mapped);
                true
            }
            Event::Delete(pod) => {
                let key = pod_key(&pod);
                self.reported.remove(&key);
                self.pods.remove(&key).is_some()
            }
        }
    }

    fn map(&mut self, pod: &Pod, cfg: &KubernetesDiscovery) -> (String, Mapped) {
        let key = pod_key(pod);
        let mapped = pod_endpoint(pod, cfg);
        match &mapped {
            Err(skip) => {
                if self.reported.insert(key.clone()) {
                    self.new_skips.push((key.clone(), skip.clone()));
                }
            }
            Ok(_) => {
                self.reported.remove(&key);
            }
        }
        (key, mapped)
    }

    /// Skips not reported before (each pod once until it maps or goes away).
    fn take_new_skips(&mut self) -> Vec<(String, Skip)> {
        std::mem::take(&mut self.new_skips)
    }

    /// The endpoint list, in pod-key order.
    pub fn endpoints(&self) -> Vec<Discovered> {
        self.pods
            .values()
            .filter_map(|m| m.as_ref().ok())
            .cloned()
            .collect()
    }
}

/// The API client and the namespace to watch. Without an override the config is inferred
/// (kubeconfig, else in-cluster service account); the namespace defaults to the config's, which
/// in a pod is its own (the service-account mount's `namespace` file).
pub async fn client(
    cfg: &KubernetesDiscovery,
    config: Option<kube::Config>,
) -> Result<(Client, String), DiscoveryError> {
    let config = match config {
        Some(c) => c,
        None => kube::Config::infer()
            .await
            .map_err(|e| DiscoveryError::Credentials(e.to_string()))?,
    };
    let namespace = cfg
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| DiscoveryError::Client(e.to_string()))?;
    Ok((client, namespace))
}

fn is_gone(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(s) if s.code == 410)
}

/// Watches the pods and hands changed lists to `sink` until `cancel`. Errors keep the list; the
/// watcher retries after kube's default backoff (0.8 s doubling to 30 s, jittered).
pub async fn run(
    cfg: KubernetesDiscovery,
    client: Client,
    namespace: String,
    sink: Sink,
    metrics: Arc<RouterMetrics>,
    cancel: CancellationToken,
) {
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let wc = watcher::Config::default().labels(&cfg.label_selector);
    let mut events = watcher::watcher(api, wc).default_backoff().boxed();
    let mut set = PodSet::default();
    let mut last: Option<Vec<Discovered>> = None;
    loop {
        let ev = tokio::select! {
            _ = cancel.cancelled() => return,
            ev = events.next() => ev,
        };
        match ev {
            None => return,
            Some(Err(e)) if is_gone(&e) => {
                metrics
                    .endpoint_changes
                    .get_or_create(&Kind {
                        kind: "discovery_relist",
                    })
                    .inc();
                tracing::info!(%namespace, "pod watch expired (410 Gone); listing again");
            }
            Some(Err(e)) => failed(&metrics, "kubernetes", &e),
            Some(Ok(ev)) => {
                if set.on_event(ev, &cfg) {
                    publish(&set, &mut last, &sink);
                }
                for (pod, why) in set.take_new_skips() {
                    skipped(&metrics);
                    tracing::info!(%pod, reason = %why, "pod is not an endpoint (yet)");
                }
            }
        }
    }
}

fn publish(set: &PodSet, last: &mut Option<Vec<Discovered>>, sink: &Sink) {
    let found = set.endpoints();
    if last.as_ref() != Some(&found) {
        sink(found.clone());
        *last = Some(found);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> KubernetesDiscovery {
        serde_norway::from_str("{label_selector: app=e}").expect("cfg")
    }

    /// A pod in the API's JSON shape: IP, named ports, Ready, annotations, labels.
    fn pod(name: &str, ip: Option<&str>, ready: bool, extra_meta: serde_json::Value) -> Pod {
        let mut meta =
            serde_json::json!({"name": name, "namespace": "kvmesh", "uid": format!("uid-{name}")});
        if let (Some(m), Some(extra)) = (meta.as_object_mut(), extra_meta.as_object()) {
            m.extend(extra.clone());
        }
        let mut status = serde_json::json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}],
        });
        if let Some(ip) = ip {
            status["podIP"] = ip.into();
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [
                {"name": "sidecar", "image": "s", "ports": [{"name": "metrics", "containerPort": 9090}]},
                {"name": "engine", "image": "e", "ports": [
                    {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                    {"name": "p2p", "containerPort": 7100},
                    {"name": "kv-events", "containerPort": 5557}]}]},
            "status": status,
        }))
        .expect("pod json")
    }

    #[test]
    fn named_ports_give_url_p2p_and_events() {
        let d = pod_endpoint(
            &pod("e0", Some("10.1.2.3"), true, serde_json::json!({})),
            &cfg(),
        )
        .expect("endpoint");
        assert!(d.ready);
        assert_eq!(d.spec.name, "kvmesh/e0");
        assert_eq!(d.spec.url, "http://10.1.2.3:8000");
        assert_eq!(d.spec.p2p.as_deref(), Some("10.1.2.3:7100"));
        let ev = d.spec.kv_events.expect("events");
        assert_eq!(
            (ev.endpoint.as_str(), ev.bind),
            ("tcp://10.1.2.3:5557", false)
        );
        assert_eq!(d.spec.role, Role::Both);
    }

    #[test]
    fn annotations_override_ports_and_bad_ones_skip() {
        let p = pod(
            "e0",
            Some("10.1.2.3"),
            true,
            serde_json::json!({"annotations": {"kvmesh.dev/http-port": "9000", "kvmesh.dev/p2p-port": "7200", "kvmesh.dev/kv-events-port": "6000"}}),
        );
        let d = pod_endpoint(&p, &cfg()).expect("endpoint");
        assert_eq!(d.spec.url, "http://10.1.2.3:9000");
        assert_eq!(d.spec.p2p.as_deref(), Some("10.1.2.3:7200"));
        assert_eq!(
            d.spec.kv_events.map(|k| k.endpoint).as_deref(),
            Some("tcp://10.1.2.3:6000")
        );
        let p = pod(
            "e0",
            Some("10.1.2.3"),
            true,
            serde_json::json!({"annotations": {"kvmesh.dev/http-port": "http"}}),
        );
        assert!(matches!(
            pod_endpoint(&p, &cfg()),
            Err(Skip::BadPort { .. })
        ));
    }

    #[test]
    fn other_port_names_and_missing_ports() {
        let mut c = cfg();
        c.ports.http = "metrics".into();
        c.ports.p2p = "none".into();
        let d = pod_endpoint(
            &pod("e0", Some("10.1.2.3"), true, serde_json::json!({})),
            &c,
        )
        .expect("endpoint");
        assert_eq!(
            (d.spec.url.as_str(), d.spec.p2p),
            ("http://10.1.2.3:9090", None)
        );
        c.ports.http = "web".into();
        assert_eq!(
            pod_endpoint(
                &pod("e0", Some("10.1.2.3"), true, serde_json::json!({})),
                &c
            ),
            Err(Skip::NoHttpPort("web".into()))
        );
    }

    #[test]
    fn missing_ip_skips_and_not_ready_is_kept_not_ready() {
        let none = serde_json::json!({});
        assert_eq!(
            pod_endpoint(&pod("e0", None, true, none.clone()), &cfg()),
            Err(Skip::NoIp)
        );
        assert_eq!(
            pod_endpoint(&pod("e0", Some("nope"), true, none.clone()), &cfg()),
            Err(Skip::BadIp("nope".into()))
        );
        let d =
            pod_endpoint(&pod("e0", Some("10.1.2.3"), false, none.clone()), &cfg()).expect("kept");
        assert!(!d.ready);
        let terminating = pod(
            "e0",
            Some("10.1.2.3"),
            true,
            serde_json::json!({"deletionTimestamp": "2026-01-01T00:00:00Z"}),
        );
        assert!(!pod_endpoint(&terminating, &cfg()).expect("kept").ready);
    }

    #[test]
    fn kv_group_from_annotation_then_label_then_config() {
        let g = |meta: serde_json::Value, c: &KubernetesDiscovery| {
            pod_endpoint(&pod("e", Some("10.0.0.1"), true, meta), c).map(|d| d.spec.kv_group)
        };
        let mut c = cfg();
        assert_eq!(g(serde_json::json!({}), &c), Ok(None));
        let label = serde_json::json!({"labels": {"kvmesh.dev/kv-group": "vllm-llama"}});
        assert_eq!(g(label.clone(), &c), Ok(Some("vllm-llama".into())));
        let both = serde_json::json!({"labels": {"kvmesh.dev/kv-group": "a"}, "annotations": {"kvmesh.dev/kv-group": "b"}});
        assert_eq!(g(both, &c), Ok(Some("b".into())));
        c.kv_group = Some("fleet".into());
        assert_eq!(g(serde_json::json!({}), &c), Ok(Some("fleet".into())));
        assert_eq!(g(label, &c), Ok(Some("vllm-llama".into())));
        // A blank label is the implicit group, not a group named "".
        c.kv_group = None;
        let blank = serde_json::json!({"labels": {"kvmesh.dev/kv-group": ""}});
        assert_eq!(g(blank, &c), Ok(None));
    }

    #[test]
    fn role_from_annotation_then_label_then_config() {
        let label = serde_json::json!({"labels": {"kvmesh.dev/role": "decode"}});
        let both = serde_json::json!({"labels": {"kvmesh.dev/role": "decode"}, "annotations": {"kvmesh.dev/role": "prefill"}});
        let mut c = cfg();
        c.role = Role::Prefill;
        let r = |p: &Pod, c: &KubernetesDiscovery| pod_endpoint(p, c).map(|d| d.spec.role);
        assert_eq!(
            r(&pod("e", Some("10.0.0.1"), true, serde_json::json!({})), &c),
            Ok(Role::Prefill)
        );
        assert_eq!(
            r(&pod("e", Some("10.0.0.1"), true, label), &c),
            Ok(Role::Decode)
        );
        assert_eq!(
            r(&pod("e", Some("10.0.0.1"), true, both), &c),
            Ok(Role::Prefill)
        );
        let bad = serde_json::json!({"labels": {"kvmesh.dev/role": "Decode"}});
        assert_eq!(
            r(&pod("e", Some("10.0.0.1"), true, bad), &c),
            Err(Skip::BadRole("Decode".into()))
        );
    }

    #[test]
    fn ipv6_pod_ip_is_bracketed() {
        let d = pod_endpoint(
            &pod("e0", Some("fd00:10::5"), true, serde_json::json!({})),
            &cfg(),
        )
        .expect("endpoint");
        assert_eq!(d.spec.url, "http://[fd00:10::5]:8000");
        assert_eq!(d.spec.p2p.as_deref(), Some("[fd00:10::5]:7100"));
        crate::config::validate_endpoints(&[d.spec]).expect("valid");
    }

    /// In a cluster the API is https: the rustls client (ring, the only crypto provider built)
    /// must build without a process-wide provider installed by hand.
    #[tokio::test]
    async fn https_client_builds_with_ring() {
        let mut config = kube::Config::new("https://127.0.0.1:6443".parse().expect("uri"));
        config.default_namespace = "kvmesh".into();
        let (_, ns) = client(&cfg(), Some(config)).await.expect("https client");
        assert_eq!(
            ns, "kvmesh",
            "the config's namespace when the YAML names none"
        );
    }

    #[test]
    fn pod_set_relists_atomically_and_reports_skips_once() {
        let c = cfg();
        let none = || serde_json::json!({});
        let mut set = PodSet::default();
        assert!(!set.on_event(Event::Init, &c));
        set.on_event(
            Event::InitApply(pod("b", Some("10.0.0.2"), true, none())),
            &c,
        );
        set.on_event(
            Event::InitApply(pod("a", Some("10.0.0.1"), false, none())),
            &c,
        );
        set.on_event(Event::InitApply(pod("p", None, false, none())), &c);
        assert!(set.endpoints().is_empty(), "nothing before InitDone");
        assert!(set.on_event(Event::InitDone, &c));
        let names = |s: &PodSet| {
            s.endpoints()
                .into_iter()
                .map(|d| (d.spec.name, d.ready))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&set),
            vec![("kvmesh/a".into(), false), ("kvmesh/b".into(), true)]
        );
        assert_eq!(set.take_new_skips().len(), 1);
        set.on_event(Event::Apply(pod("p", None, false, none())), &c);
        assert!(set.take_new_skips().is_empty(), "reported once");
        set.on_event(Event::Apply(pod("a", Some("10.0.0.1"), true, none())), &c);
        assert_eq!(names(&set)[0], ("kvmesh/a".into(), true));
        set.on_event(Event::Delete(pod("b", Some("10.0.0.2"), true, none())), &c);
        assert_eq!(names(&set), vec![("kvmesh/a".into(), true)]);
        set.on_event(Event::Init, &c);
        set.on_event(
            Event::InitApply(pod("c", Some("10.0.0.3"), true, none())),
            &c,
        );
        assert_eq!(names(&set).len(), 1, "old list until the re-list is done");
        set.on_event(Event::InitDone, &c);
        assert_eq!(names(&set), vec![("kvmesh/c".into(), true)]);
    }
}
