//! Endpoint discovery end to end: a router with `discovery: dns` against a DNS server this test
//! runs (hand-encoded answers over UDP on loopback), and one with `discovery: kubernetes` against
//! a fake Kubernetes API server serving the API's list and watch wire format from
//! `tests/fixtures/kubernetes/` (strict about paths and query parameters). Discovered addresses
//! are loopback ones; health checks and scrapes are pushed out of the way (1 h interval,
//! unreachable ejection threshold) so readiness alone decides placeability.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kvmesh_index::EndpointId;
use kvmesh_router::discovery::DiscoveryOverrides;
use kvmesh_router::metrics::Kind;
use kvmesh_router::{RouterConfig, RouterHandle, RouterOptions};
use parking_lot::Mutex;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;

const QUIET_LOOPS: &str = "health_check: {interval: 3600s, unhealthy_threshold: 1000}\n\
                           metrics_scrape_interval: 3600s\n";

async fn start(yaml: &str, discovery: DiscoveryOverrides) -> RouterHandle {
    let config: RouterConfig = serde_norway::from_str(yaml).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let opts = RouterOptions {
        discovery,
        ..Default::default()
    };
    tokio::time::timeout(
        Duration::from_secs(10),
        kvmesh_router::start(config, listener, opts),
    )
    .await
    .expect("router starts in time")
    .expect("router starts")
}

/// (name, id, placeable) of every endpoint, in list order.
fn endpoints(r: &RouterHandle) -> Vec<(String, EndpointId, bool)> {
    r.state
        .endpoints
        .list()
        .iter()
        .map(|e| (e.name.to_string(), e.id, e.is_healthy()))
        .collect()
}

fn names(r: &RouterHandle) -> Vec<String> {
    endpoints(r).into_iter().map(|(n, _, _)| n).collect()
}

fn id_of(r: &RouterHandle, name: &str) -> EndpointId {
    endpoints(r)
        .into_iter()
        .find(|(n, _, _)| n == name)
        .unwrap_or_else(|| panic!("no endpoint {name}"))
        .1
}

fn changes(r: &RouterHandle, kind: &'static str) -> u64 {
    r.state
        .metrics
        .endpoint_changes
        .get_or_create(&Kind { kind })
        .get()
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn shutdown(r: RouterHandle) {
    tokio::time::timeout(Duration::from_secs(10), r.shutdown())
        .await
        .expect("router stops in time")
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// dns

enum Answer {
    Addrs(Vec<IpAddr>),
    ServFail,
    NxDomain,
}

/// A reply to a DNS query (RFC 1035 §4.1): the question echoed, A or AAAA records with TTL 0.
fn dns_reply(q: &[u8], answer: &Answer) -> Option<Vec<u8>> {
    let mut i = 12;
    while *q.get(i)? != 0 {
        i += 1 + usize::from(q[i]);
    }
    let question = q.get(12..i + 5)?;
    let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
    let (rcode, records): (u8, Vec<IpAddr>) = match answer {
        Answer::ServFail => (2, vec![]),
        Answer::NxDomain => (3, vec![]),
        Answer::Addrs(a) => (
            0,
            a.iter()
                .filter(|ip| (qtype == 1 && ip.is_ipv4()) || (qtype == 28 && ip.is_ipv6()))
                .copied()
                .collect(),
        ),
    };
    let mut r = q[0..2].to_vec();
    r.push(0x84 | (q[2] & 0x01)); // QR, AA, RD as asked
    r.push(0x80 | rcode); // RA
    for n in [1, records.len() as u16, 0, 0] {
        r.extend(n.to_be_bytes());
    }
    r.extend_from_slice(question);
    for ip in records {
        r.extend([0xc0, 0x0c]); // the question's name
        let (rtype, data) = match ip {
            IpAddr::V4(v4) => (1u16, v4.octets().to_vec()),
            IpAddr::V6(v6) => (28u16, v6.octets().to_vec()),
        };
        r.extend(rtype.to_be_bytes());
        r.extend(1u16.to_be_bytes());
        r.extend(0u32.to_be_bytes());
        r.extend((data.len() as u16).to_be_bytes());
        r.extend(data);
    }
    Some(r)
}

struct DnsServer {
    addr: std::net::SocketAddr,
    answer: Arc<Mutex<Answer>>,
    queries: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn dns_server(answer: Answer) -> DnsServer {
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    let answer = Arc::new(Mutex::new(answer));
    let queries = Arc::new(AtomicUsize::new(0));
    let task = tokio::spawn({
        let (answer, queries) = (answer.clone(), queries.clone());
        async move {
            let mut buf = [0u8; 1500];
            while let Ok((n, peer)) = sock.recv_from(&mut buf).await {
                queries.fetch_add(1, Ordering::Relaxed);
                let reply = dns_reply(&buf[..n], &answer.lock());
                if let Some(reply) = reply {
                    let _ = sock.send_to(&reply, peer).await;
                }
            }
        }
    });
    DnsServer {
        addr,
        answer,
        queries,
        task,
    }
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[tokio::test]
async fn dns_discovery_follows_the_answers_and_keeps_ids() {
    let dns = dns_server(Answer::Addrs(ips(&["127.0.0.12", "::1", "127.0.0.11"]))).await;
    let yaml = format!(
        "discovery:\n  kind: dns\n  name: kvmesh-engines.kvmesh.svc.cluster.local\n  \
         interval: 100ms\n  http_port: 18000\n  p2p_port: 17100\n  nameserver: \"{}\"\n{QUIET_LOOPS}",
        dns.addr
    );
    let r = start(&yaml, DiscoveryOverrides::default()).await;
    let three = [
        "dns:127.0.0.11:18000",
        "dns:127.0.0.12:18000",
        "dns:[::1]:18000",
    ];
    eventually("the first answer", || names(&r) == three).await;
    assert!(endpoints(&r).iter().all(|(_, _, ok)| *ok));
    let e12 = r.state.endpoints.get(id_of(&r, three[1])).unwrap();
    assert_eq!(e12.spec.url, "http://127.0.0.12:18000");
    assert_eq!(e12.spec.p2p.as_deref(), Some("127.0.0.12:17100"));
    let v6 = r.state.endpoints.get(id_of(&r, three[2])).unwrap();
    assert_eq!(v6.spec.url, "http://[::1]:18000");
    let (id11, id12, id6) = (
        id_of(&r, three[0]),
        id_of(&r, three[1]),
        id_of(&r, three[2]),
    );

    *dns.answer.lock() = Answer::Addrs(ips(&["127.0.0.13", "127.0.0.12"]));
    let two = ["dns:127.0.0.12:18000", "dns:127.0.0.13:18000"];
    eventually("an address added, two removed", || names(&r) == two).await;
    assert_eq!(id_of(&r, two[0]), id12, "an unchanged address keeps its id");
    assert!(r.state.endpoints.get(id11).is_none());
    assert!(r.state.endpoints.get(id6).is_none());
    assert_eq!(changes(&r, "removed"), 2);

    *dns.answer.lock() = Answer::ServFail;
    eventually("a failure counted", || changes(&r, "discovery_failed") >= 1).await;
    let seen = dns.queries.load(Ordering::Relaxed);
    eventually("retried", || dns.queries.load(Ordering::Relaxed) > seen + 2).await;
    assert_eq!(names(&r), two, "a failed resolution keeps the list");
    assert_eq!(id_of(&r, two[0]), id12);

    *dns.answer.lock() = Answer::NxDomain;
    eventually("no address: no endpoint", || names(&r).is_empty()).await;
    *dns.answer.lock() = Answer::Addrs(ips(&["127.0.0.12"]));
    eventually("back", || names(&r) == [two[0]]).await;
    assert_ne!(
        id_of(&r, two[0]),
        id12,
        "removed and found again is a new endpoint"
    );
    shutdown(r).await;
}

// ---------------------------------------------------------------------------------------------
// kubernetes

const SELECTOR: &str = "app.kubernetes.io/component=kvmesh-engine";

fn fixture(name: &str) -> String {
    let p: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "../../tests/fixtures/kubernetes",
        name,
    ]
    .iter()
    .collect();
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

struct FakeApi {
    requests: Mutex<Vec<String>>,
    /// Requests the real apiserver would answer differently (wrong path, namespace, selector,
    /// query parameter); the test fails if there is any.
    unexpected: Mutex<Vec<String>>,
    lists: AtomicUsize,
    /// The body of the first watch (resourceVersion 1000), fed line by line by the test.
    first_watch: Mutex<Option<mpsc::Receiver<Bytes>>>,
}

impl FakeApi {
    fn reject(&self, why: &str, uri: &Uri) -> Response {
        self.unexpected.lock().push(format!("{why}: {uri}"));
        (StatusCode::BAD_REQUEST, why.to_owned()).into_response()
    }
}

fn json_response(body: String) -> Response {
    ([("content-type", "application/json")], body).into_response()
}

const LIST_PARAMS: &[&str] = &["labelSelector", "limit"];
const WATCH_PARAMS: &[&str] = &[
    "watch",
    "timeoutSeconds",
    "labelSelector",
    "allowWatchBookmarks",
    "resourceVersion",
];

async fn pods(
    State(api): State<Arc<FakeApi>>,
    Path(ns): Path<String>,
    uri: Uri,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    api.requests.lock().push(uri.to_string());
    let param = |k: &str| q.get(k).map(String::as_str);
    if ns != "kvmesh" {
        return api.reject("namespace", &uri);
    }
    if param("labelSelector") != Some(SELECTOR) {
        return api.reject("labelSelector", &uri);
    }
    let watching = param("watch") == Some("true");
    let allowed = if watching { WATCH_PARAMS } else { LIST_PARAMS };
    if let Some(k) = q.keys().find(|k| !allowed.contains(&k.as_str())) {
        return api.reject(&format!("unexpected parameter {k}"), &uri);
    }
    if !watching {
        let n = api.lists.fetch_add(1, Ordering::Relaxed);
        let file = if n == 0 {
            "pods-list.json"
        } else {
            "pods-list-after-gone.json"
        };
        return json_response(fixture(file));
    }
    if param("allowWatchBookmarks") != Some("true") || param("timeoutSeconds").is_none() {
        return api.reject("watch without bookmarks or timeout", &uri);
    }
    match param("resourceVersion") {
        Some("1000") => {
            let Some(rx) = api.first_watch.lock().take() else {
                return api.reject("a second watch from 1000", &uri);
            };
            let lines = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
            });
            Body::from_stream(lines).into_response()
        }
        // After the re-list: a watch that stays open with nothing to say.
        Some("2000") => Body::from_stream(futures::stream::pending::<Result<Bytes, Infallible>>())
            .into_response(),
        _ => api.reject("watch from an unexpected resourceVersion", &uri),
    }
}

async fn fallback(State(api): State<Arc<FakeApi>>, uri: Uri) -> Response {
    api.reject("path", &uri);
    StatusCode::NOT_FOUND.into_response()
}

#[tokio::test]
async fn kubernetes_discovery_follows_the_pod_watch_through_a_410_relist() {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let api = Arc::new(FakeApi {
        requests: Mutex::new(Vec::new()),
        unexpected: Mutex::new(Vec::new()),
        lists: AtomicUsize::new(0),
        first_watch: Mutex::new(Some(rx)),
    });
    let app = Router::new()
        .route("/api/v1/namespaces/{ns}/pods", get(pods))
        .fallback(fallback)
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let kube_config = kube::Config::new(format!("http://{api_addr}").parse().unwrap());
    let yaml = format!(
        "discovery:\n  kind: kubernetes\n  namespace: kvmesh\n  label_selector: {SELECTOR}\n{QUIET_LOOPS}"
    );
    let r = start(
        &yaml,
        DiscoveryOverrides {
            kube_config: Some(kube_config),
        },
    )
    .await;
    let (e0, e1, e2, e3) = (
        "kvmesh/kvmesh-engine-0",
        "kvmesh/kvmesh-engine-1",
        "kvmesh/kvmesh-engine-2",
        "kvmesh/kvmesh-engine-3",
    );
    let placeable = |r: &RouterHandle| -> Vec<(String, bool)> {
        endpoints(r).into_iter().map(|(n, _, ok)| (n, ok)).collect()
    };
    let want = |v: &[(&str, bool)]| -> Vec<(String, bool)> {
        v.iter().map(|(n, ok)| (n.to_string(), *ok)).collect()
    };

    // The list: a ready pod, a not-ready one (kept, not placeable), one without an IP (skipped).
    eventually("the initial list", || {
        placeable(&r) == want(&[(e0, true), (e1, false)])
    })
    .await;
    assert_eq!(changes(&r, "discovery_skipped"), 1);
    let ep0 = r.state.endpoints.get(id_of(&r, e0)).unwrap();
    assert_eq!(ep0.spec.url, "http://127.0.0.21:8000");
    assert_eq!(ep0.spec.p2p.as_deref(), Some("127.0.0.21:7100"));
    assert_eq!(
        ep0.spec.kv_events.as_ref().map(|k| k.endpoint.as_str()),
        Some("tcp://127.0.0.21:5557")
    );
    let (id0, id1) = (id_of(&r, e0), id_of(&r, e1));
    eventually("the watch from the list's resourceVersion", || {
        api.requests
            .lock()
            .iter()
            .any(|q| q.contains("watch=true") && q.contains("resourceVersion=1000"))
    })
    .await;

    let events: Vec<String> = fixture("watch-events.jsonl")
        .lines()
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(events.len(), 6);
    let send = |i: usize| {
        let tx = tx.clone();
        let line = Bytes::from(events[i].clone());
        async move { tx.send(line).await.unwrap() }
    };

    send(0).await; // MODIFIED: engine-1 Ready
    eventually("engine-1 ready", || {
        placeable(&r) == want(&[(e0, true), (e1, true)])
    })
    .await;
    assert_eq!(id_of(&r, e1), id1, "readiness flips keep the id");

    send(1).await; // BOOKMARK
    send(2).await; // ADDED: engine-2, role decode, http port by annotation
    eventually("engine-2 added", || {
        placeable(&r) == want(&[(e0, true), (e1, true), (e2, true)])
    })
    .await;
    assert_eq!(
        (id_of(&r, e0), id_of(&r, e1)),
        (id0, id1),
        "bookmark: no change"
    );
    let ep2 = r.state.endpoints.get(id_of(&r, e2)).unwrap();
    assert_eq!(ep2.spec.url, "http://127.0.0.23:8001");
    assert_eq!(ep2.spec.role, kvmesh_router::config::Role::Decode);
    let id2 = ep2.id;

    send(3).await; // MODIFIED: engine-0 not Ready
    eventually("engine-0 not ready", || {
        placeable(&r) == want(&[(e0, false), (e1, true), (e2, true)])
    })
    .await;
    assert_eq!(
        id_of(&r, e0),
        id0,
        "not ready keeps the endpoint and its id"
    );
    let debug: serde_json::Value = reqwest::get(format!("http://{}/debug/endpoints", r.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(debug[0]["name"], e0);
    assert_eq!(
        (&debug[0]["ready"], &debug[0]["healthy"]),
        (&false.into(), &false.into())
    );
    assert_eq!(debug[1]["ready"], true);

    send(4).await; // DELETED: engine-1
    eventually("engine-1 removed", || {
        placeable(&r) == want(&[(e0, false), (e2, true)])
    })
    .await;
    assert!(r.state.endpoints.get(id1).is_none());

    send(5).await; // ERROR 410 Gone: the apiserver ends the watch; the watcher lists again
    drop(tx);
    eventually("the list after 410", || {
        placeable(&r) == want(&[(e0, true), (e2, true), (e3, true)])
    })
    .await;
    assert_eq!(id_of(&r, e0), id0, "unchanged across the re-list");
    assert_ne!(id_of(&r, e2), id2, "a new pod IP is a new endpoint");
    assert_eq!(
        r.state.endpoints.get(id_of(&r, e2)).unwrap().spec.url,
        "http://127.0.0.25:8001"
    );
    assert_eq!(
        r.state.endpoints.get(id_of(&r, e3)).unwrap().spec.role,
        kvmesh_router::config::Role::Prefill
    );
    eventually("the watch from the new list's resourceVersion", || {
        api.requests
            .lock()
            .iter()
            .any(|q| q.contains("watch=true") && q.contains("resourceVersion=2000"))
    })
    .await;
    assert_eq!(changes(&r, "discovery_relist"), 1);
    assert_eq!(changes(&r, "discovery_failed"), 0);
    assert_eq!(api.lists.load(Ordering::Relaxed), 2);
    let unexpected = api.unexpected.lock().clone();
    assert!(
        unexpected.is_empty(),
        "requests a real apiserver would refuse: {unexpected:?}"
    );
    println!("requests: {:#?}", api.requests.lock());
    shutdown(r).await;
    server.abort();
}

#[tokio::test]
async fn kubernetes_discovery_without_credentials_fails_at_start() {
    let home_config = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".kube/config"))
        .is_some_and(|p| p.exists());
    if std::env::var_os("KUBECONFIG").is_some()
        || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        || home_config
    {
        println!(
            "skipped: this machine has Kubernetes credentials (KUBECONFIG, ~/.kube/config or in-cluster)"
        );
        return;
    }
    let config: RouterConfig = serde_norway::from_str(&format!(
        "discovery: {{kind: kubernetes, label_selector: \"{SELECTOR}\"}}\n{QUIET_LOOPS}"
    ))
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let started = tokio::time::timeout(
        Duration::from_secs(10),
        kvmesh_router::start(config, listener, RouterOptions::default()),
    )
    .await
    .expect("fails in time");
    let Err(err) = started else {
        panic!("a router without Kubernetes credentials started")
    };
    let msg = err.to_string();
    println!("start error: {msg}");
    assert!(msg.contains("no Kubernetes API credentials"), "{msg}");
    assert!(msg.contains("service account"), "{msg}");
}
