//! The file-descriptor side of the connection cap: a server never admits more connections than
//! half its open-file limit, or it would fail every accept and upstream connect with EMFILE
//! (20,000 slow clients did that to the router, issue 37).

/// The process's soft limit on open file descriptors (`/proc/self/limits`, Linux), if known.
pub fn open_files_soft_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_open_files_limit(&limits)
}

fn parse_open_files_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The connection cap actually applied: the configured one, but never more than half the
/// process's file descriptors, so the server keeps descriptors for its own upstream connections,
/// sockets and files (past the fd limit, every accept and connect fails with EMFILE).
pub fn effective_max_connections(configured: usize, fd_soft_limit: Option<u64>) -> usize {
    match fd_soft_limit {
        Some(fds) => configured.min(usize::try_from(fds / 2).unwrap_or(usize::MAX).max(1)),
        None => configured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_half_the_file_descriptors() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_open_files_limit(limits), Some(1024));
        assert_eq!(effective_max_connections(8192, Some(1024)), 512);
        assert_eq!(effective_max_connections(100, Some(1024)), 100);
        assert_eq!(effective_max_connections(8192, None), 8192);
    }
}
