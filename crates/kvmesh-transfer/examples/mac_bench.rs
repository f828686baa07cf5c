//! What authenticating (or encrypting) KV costs per core, against a plain memcpy: the
//! measurement behind the choice of frame protection (`docs/protocols.md#frame-authentication`).
//!
//! `cargo run --release -p kvmesh-transfer --example mac_bench [-- --reps N --total-mb N]`
//!
//! One thread, one message at a time, for messages of 256 KiB, 1 MiB and 4 MiB (a block of a few
//! hundred tokens to a few thousand): GB of message bytes per CPU-second of the thread (its
//! on-CPU time, so a shared machine's other load does not count; it still shares caches and
//! memory bandwidth), the median of `--reps` passes over `--total-mb` MB each, the passes of all
//! candidates interleaved. Candidates:
//! - memcpy (reference) and CRC32 (what every block already pays);
//! - HMAC-SHA256 (protocol v2's per-frame MAC; SHA-NI where the CPU has it);
//! - BLAKE3 keyed (the `blake3` crate, its AVX-512 code where available);
//! - AES-256-GCM and ChaCha20-Poly1305 from `ring`, sealing in place; AES-256-GCM opening; and
//!   AES-256-GCM with the message as associated data (GMAC through ring);
//! - RustCrypto `aes-gcm` with the message as associated data (standard GMAC);
//! - AES-256-GCM from `aws-lc-rs` (AWS-LC: 512-bit VAES/VPCLMULQDQ where the CPU has them):
//!   seal, open, and with the message as AAD (GMAC); AES-128-GCM seal (10 rounds, not 14);
//! - protocol v3's POLYVAL-AES tag (RustCrypto `polyval` and `aes`), in 256 KiB records;
//! - the protocol's own record protection (`kvmesh_transfer::mac::RecordKey`), in 256 KiB
//!   records as the wire carries them: AES-256-GMAC tags in clear (authenticate), and AES-256-GCM
//!   the way the producer runs it (encrypt each record from the shared source into a staging
//!   buffer) and the consumer runs it (open in place).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;

use aes_gcm::aead::{AeadInOut, KeyInit};
use kvmesh_transfer::mac::{DirectionKey, Protection, RecordKey};
use kvmesh_transfer::record;

struct Args {
    reps: usize,
    total_mb: usize,
}

fn args() -> Args {
    let mut a = Args {
        reps: 9,
        total_mb: 128,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let v: usize = pair
            .get(1)
            .and_then(|v| v.parse().ok())
            .expect("flag value");
        match pair[0].as_str() {
            "--reps" => a.reps = v,
            "--total-mb" => a.total_mb = v,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (nanoseconds on a CPU):
/// unlike wall time it does not count the time other processes of a shared machine held the
/// core.
fn thread_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0.0, |ns| ns as f64 / 1e9)
}

/// GB per CPU-second of one pass running `f` over `total` bytes in messages of `buf`'s size.
fn pass(buf: &mut [u8], total: usize, f: &mut dyn FnMut(&mut [u8])) -> f64 {
    let iters = (total / buf.len()).max(1);
    let t = thread_cpu_seconds();
    for _ in 0..iters {
        f(buf);
        black_box(&buf);
    }
    (iters * buf.len()) as f64 / (thread_cpu_seconds() - t).max(1e-9) / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ring_key(alg: &'static ring::aead::Algorithm) -> ring::aead::LessSafeKey {
    let key = vec![7u8; alg.key_len()];
    ring::aead::LessSafeKey::new(ring::aead::UnboundKey::new(alg, &key).unwrap())
}

fn nonce() -> ring::aead::Nonce {
    ring::aead::Nonce::assume_unique_for_key([0; 12])
}

fn aws_key() -> aws_lc_rs::aead::LessSafeKey {
    aws_key_of(&aws_lc_rs::aead::AES_256_GCM)
}

fn aws_key_of(alg: &'static aws_lc_rs::aead::Algorithm) -> aws_lc_rs::aead::LessSafeKey {
    let key = vec![7u8; alg.key_len()];
    aws_lc_rs::aead::LessSafeKey::new(aws_lc_rs::aead::UnboundKey::new(alg, &key).unwrap())
}

fn aws_nonce() -> aws_lc_rs::aead::Nonce {
    aws_lc_rs::aead::Nonce::assume_unique_for_key([0; 12])
}

/// Protocol v3's tag: `POLYVAL(H, pad16(record) | LE64(bits) | LE64(0)) XOR AES-256(K, LE64(seq)
/// | 0^64)`.
struct PolyvalAes {
    polyval: polyval::Polyval,
    mask: aes::Aes256,
}

impl PolyvalAes {
    fn new(key: [u8; 32], h: [u8; 16]) -> Self {
        use aes::cipher::KeyInit;
        Self {
            polyval: polyval::Polyval::new(&h.into()),
            mask: aes::Aes256::new(&key.into()),
        }
    }

    fn tag(&self, seq: u64, record: &[u8]) -> [u8; 16] {
        use aes::cipher::BlockCipherEncrypt;
        use polyval::universal_hash::UniversalHash;
        let mut hash = self.polyval.clone();
        hash.update_padded(record);
        let mut lengths = [0u8; 16];
        lengths[..8].copy_from_slice(&(record.len() as u64 * 8).to_le_bytes());
        hash.update(&[lengths.into()]);
        let mut pad = [0u8; 16];
        pad[..8].copy_from_slice(&seq.to_le_bytes());
        let mut pad = pad.into();
        self.mask.encrypt_block(&mut pad);
        let mut tag = [0u8; 16];
        for ((t, h), p) in tag.iter_mut().zip(hash.finalize().iter()).zip(pad.iter()) {
            *t = h ^ p;
        }
        tag
    }
}

type Candidate = (&'static str, Box<dyn FnMut(&mut [u8])>);

fn candidates(size: usize) -> Vec<Candidate> {
    let src = vec![3u8; size];
    let aes = ring_key(&ring::aead::AES_256_GCM);
    let aes_aad = ring_key(&ring::aead::AES_256_GCM);
    let aes_open = ring_key(&ring::aead::AES_256_GCM);
    let chacha = ring_key(&ring::aead::CHACHA20_POLY1305);
    let gmac = aes_gcm::Aes256Gcm::new(&[7u8; 32].into());
    // A sealed message to open (restored before each open: the copy is part of that column).
    let mut sealed = src.clone();
    let tag = aes_open
        .seal_in_place_separate_tag(nonce(), ring::aead::Aad::empty(), &mut sealed)
        .unwrap();
    let auth = DirectionKey::from_material(Protection::Authenticate, [9; 32]);
    let enc = DirectionKey::from_material(Protection::Encrypt, [9; 32]);
    let mut tagger = RecordKey::new(&auth);
    let mut sealer = RecordKey::new(&enc);
    let mut staging = vec![0u8; record::payload_wire_len(size, true)];
    let polyval_aes = PolyvalAes::new([9; 32], [8; 16]);
    // Records sealed under consecutive sequence numbers, for the opening column.
    let mut wire = Vec::new();
    let mut wire_sealer = RecordKey::new(&enc);
    for r in record::record_ranges(size) {
        record::seal_record_into(&mut wire_sealer, &src[r], &mut wire);
    }
    let mut work = wire.clone();
    let lc = aws_key();
    let lc_aad = aws_key();
    let lc_128 = aws_key_of(&aws_lc_rs::aead::AES_128_GCM);
    let lc_open = aws_key();
    let mut lc_sealed = src.clone();
    let lc_tag = lc_open
        .seal_in_place_separate_tag(aws_nonce(), aws_lc_rs::aead::Aad::empty(), &mut lc_sealed)
        .unwrap();
    vec![
        (
            "memcpy",
            Box::new(move |b: &mut [u8]| b.copy_from_slice(&src)) as Box<dyn FnMut(&mut [u8])>,
        ),
        (
            "crc32 (crc32fast)",
            Box::new(|b: &mut [u8]| {
                black_box(crc32fast::hash(b));
            }),
        ),
        (
            "HMAC-SHA256",
            Box::new(|b: &mut [u8]| {
                black_box(kvmesh_transfer::auth::hmac_sha256(&[1; 32], &[b]));
            }),
        ),
        (
            "BLAKE3 keyed",
            Box::new(|b: &mut [u8]| {
                black_box(blake3::keyed_hash(&[1; 32], b));
            }),
        ),
        (
            "ring AES-256-GCM seal",
            Box::new(move |b: &mut [u8]| {
                let t = aes.seal_in_place_separate_tag(nonce(), ring::aead::Aad::empty(), b);
                let _ = black_box(t.unwrap());
            }),
        ),
        (
            "ring AES-256-GCM open (+copy)",
            Box::new(move |b: &mut [u8]| {
                b.copy_from_slice(&sealed);
                let aad = ring::aead::Aad::empty();
                let p = aes_open.open_in_place_separate_tag(nonce(), aad, tag, b, 0..);
                black_box(p.unwrap());
            }),
        ),
        (
            "ring ChaCha20-Poly1305 seal",
            Box::new(move |b: &mut [u8]| {
                let t = chacha.seal_in_place_separate_tag(nonce(), ring::aead::Aad::empty(), b);
                let _ = black_box(t.unwrap());
            }),
        ),
        (
            "ring AES-256-GCM, msg as AAD",
            Box::new(move |b: &mut [u8]| {
                let aad = ring::aead::Aad::from(&*b);
                let t = aes_aad.seal_in_place_separate_tag(nonce(), aad, &mut []);
                let _ = black_box(t.unwrap());
            }),
        ),
        (
            "aws-lc-rs AES-256-GCM seal",
            Box::new(move |b: &mut [u8]| {
                let t =
                    lc.seal_in_place_separate_tag(aws_nonce(), aws_lc_rs::aead::Aad::empty(), b);
                let _ = black_box(t.unwrap());
            }),
        ),
        (
            "aws-lc-rs AES-128-GCM seal",
            Box::new(move |b: &mut [u8]| {
                let aad = aws_lc_rs::aead::Aad::empty();
                let t = lc_128.seal_in_place_separate_tag(aws_nonce(), aad, b);
                let _ = black_box(t.unwrap());
            }),
        ),
        (
            "aws-lc-rs AES-256-GCM open (+copy)",
            Box::new(move |b: &mut [u8]| {
                b.copy_from_slice(&lc_sealed);
                let aad = aws_lc_rs::aead::Aad::empty();
                let p = lc_open.open_in_place_separate_tag(aws_nonce(), aad, lc_tag.as_ref(), b);
                black_box(p.unwrap());
            }),
        ),
        (
            "aws-lc-rs AES-256-GCM, msg as AAD",
            Box::new(move |b: &mut [u8]| {
                let aad = aws_lc_rs::aead::Aad::from(&*b);
                let t = lc_aad.seal_in_place_separate_tag(aws_nonce(), aad, &mut []);
                let _ = black_box(t.unwrap());
            }),
        ),
        (
            "RustCrypto GMAC (aes-gcm AAD)",
            Box::new(move |b: &mut [u8]| {
                let empty: &mut [u8] = &mut [];
                let t = gmac.encrypt_inout_detached(&[0u8; 12].into(), b, empty.into());
                black_box(t.unwrap());
            }),
        ),
        (
            "v3 authenticate (POLYVAL-AES)",
            Box::new(move |b: &mut [u8]| {
                for (seq, r) in record::record_ranges(b.len()).enumerate() {
                    black_box(polyval_aes.tag(seq as u64, &b[r]));
                }
            }),
        ),
        (
            "kvmesh authenticate (AES-256-GMAC)",
            Box::new(move |b: &mut [u8]| {
                for r in record::record_ranges(b.len()) {
                    black_box(tagger.tag(&b[r]));
                }
            }),
        ),
        (
            "kvmesh encrypt: producer",
            Box::new(move |b: &mut [u8]| {
                let mut at = 0;
                for r in record::record_ranges(b.len()) {
                    let len = r.len();
                    let tag = sealer.seal_to(&b[r], &mut staging[at..at + len]);
                    staging[at + len..at + len + 16].copy_from_slice(&tag);
                    at += len + 16;
                }
                black_box(&staging);
            }),
        ),
        (
            "kvmesh encrypt: consumer (+copy)",
            Box::new(move |_: &mut [u8]| {
                // Every pass opens the same records from sequence number 0.
                let mut opener = RecordKey::new(&enc);
                work.copy_from_slice(&wire);
                let mut at = 0;
                for r in record::record_ranges(size) {
                    let len = r.len();
                    let (rec, rest) = work[at..].split_at_mut(len);
                    opener.open(rec, 0, &rest[..16]).unwrap();
                    at += len + 16;
                }
            }),
        ),
    ]
}

fn main() {
    let a = args();
    let sizes = [256 << 10, 1 << 20, 4 << 20];
    println!(
        "one thread, median of {} passes over {} MB; GB of message bytes per CPU-second",
        a.reps, a.total_mb
    );
    println!(
        "{:<36} {:>9} {:>9} {:>9}",
        "candidate", "256 KiB", "1 MiB", "4 MiB"
    );
    let mut table: Vec<(&str, Vec<f64>)> = Vec::new();
    for &size in &sizes {
        let mut cands = candidates(size);
        let mut buf = vec![0x5au8; size];
        for (_, f) in cands.iter_mut() {
            for _ in 0..4 {
                f(&mut buf);
            }
        }
        // Passes interleaved across candidates, so a burst of load on a shared machine hits
        // them alike; the median pass per candidate.
        let mut rates = vec![Vec::new(); cands.len()];
        for _ in 0..a.reps {
            for (i, (_, f)) in cands.iter_mut().enumerate() {
                rates[i].push(pass(&mut buf, a.total_mb << 20, f.as_mut()));
            }
        }
        for (i, ((name, _), r)) in cands.iter().zip(rates).enumerate() {
            if table.len() <= i {
                table.push((name, Vec::new()));
            }
            table[i].1.push(median(r));
        }
    }
    for (name, rates) in &table {
        print!("{name:<36}");
        for r in rates {
            print!(" {r:>9.2}");
        }
        println!();
    }
}
