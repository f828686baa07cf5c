//! Server-sent events as OpenAI-style streaming endpoints send them: a reader of the `data:`
//! fields of a byte stream that arrives in arbitrary chunks. The bench's client and the router's
//! P/D response tap both read streams with it. No I/O: the caller feeds the bytes.

/// Incremental reader of an SSE stream's `data:` lines.
///
/// Feed chunks with [`SseDataReader::push`] as they arrive, then take every complete `data:`
/// line with [`SseDataReader::next_data`]. Each `data:` line is returned on its own (OpenAI
/// streams put one JSON document per event on one line); other lines — blank event separators,
/// `event:`, `id:`, `:` comments — are skipped. Lines end with `\n` or `\r\n`.
#[derive(Debug, Default)]
pub struct SseDataReader {
    buf: Vec<u8>,
}

impl SseDataReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The value of the next complete `data:` line: without the field name, the one optional
    /// space after it, and the line end. `None` until a complete `data:` line is buffered.
    pub fn next_data(&mut self) -> Option<Vec<u8>> {
        loop {
            let nl = self.buf.iter().position(|&b| b == b'\n')?;
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = &line[..nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(value) = line.strip_prefix(b"data:") {
                return Some(value.strip_prefix(b" ").unwrap_or(value).to_vec());
            }
        }
    }

    /// Bytes buffered that do not form a complete line yet.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(r: &mut SseDataReader) -> Vec<String> {
        std::iter::from_fn(|| r.next_data())
            .map(|d| String::from_utf8_lossy(&d).into_owned())
            .collect()
    }

    #[test]
    fn reads_data_lines_across_chunk_boundaries() {
        let mut r = SseDataReader::new();
        r.push(b"data: {\"a\":");
        assert!(r.next_data().is_none(), "half a line is not a value");
        r.push(b"1}\n\nevent: x\r\n: comment\ndata:[DONE]\r\n\r\ndata: tail");
        assert_eq!(all(&mut r), vec!["{\"a\":1}", "[DONE]"]);
        assert_eq!(r.pending(), "data: tail".len());
        r.push(b"\n");
        assert_eq!(all(&mut r), vec!["tail"]);
    }

    #[test]
    fn only_one_leading_space_is_the_separator() {
        let mut r = SseDataReader::new();
        r.push(b"data:  two\ndata:\n");
        assert_eq!(all(&mut r), vec![" two", ""]);
    }
}
