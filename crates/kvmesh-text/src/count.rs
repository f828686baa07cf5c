//! Counting a long text's tokens with bounded memory ([`count_past`]), for callers that must
//! refuse an over-long prompt before encoding it whole.

use crate::{TextError, Tokenizer};

/// Text longer than this is counted a piece at a time before it is encoded whole: longer than
/// any real context (128K tokens are ~0.5 MiB of text), so ordinary prompts are tokenized once.
pub const COUNT_IN_PIECES_ABOVE: usize = 1 << 20;

/// The piece: the tokenizer's working memory while counting is that of this much text.
pub const COUNT_PIECE_BYTES: usize = 64 << 10;

/// Counts `text`'s tokens a piece of about [`COUNT_PIECE_BYTES`] at a time and says how many it
/// counted once that is past `max_prompt_tokens`, without encoding the rest; `None` when the
/// whole text fits.
///
/// Why: a length check (`text.len() / max_text_bytes_per_token()`) is only a proof for
/// tokenizers whose tokens are short. An HF vocabulary has tokens of dozens of bytes, so it lets
/// a 60 MiB prompt through, and encoding that whole builds per-token strings and offsets worth
/// dozens of times the text. A piece at a time,
/// the tokenizer's working memory is one piece's. Pieces end before a whitespace character
/// (where the common pre-tokenizers split words anyway), so counts match a whole encode up to
/// one token per piece (the beginning-of-sequence token each piece's encode may add); the text
/// is refused only when it is past the limit by more than that.
pub fn count_past(
    tokenizer: &dyn Tokenizer,
    text: &str,
    max_prompt_tokens: usize,
) -> Result<Option<usize>, TextError> {
    let mut counted = 0usize;
    let mut pieces = 0usize;
    let mut rest = text;
    while !rest.is_empty() {
        let end = piece_end(rest, COUNT_PIECE_BYTES);
        let (piece, tail) = rest.split_at(end);
        counted += tokenizer.encode(piece)?.len();
        pieces += 1;
        if counted.saturating_sub(pieces) > max_prompt_tokens {
            return Ok(Some(counted - pieces));
        }
        rest = tail;
    }
    Ok(None)
}

/// Where a piece of `text` of about `target` bytes ends: before the first whitespace character
/// at or after `target` (within 4 KiB of it), else at the char boundary at `target`; the whole
/// text when it is shorter.
fn piece_end(text: &str, target: usize) -> usize {
    if text.len() <= target {
        return text.len();
    }
    let mut at = target;
    while !text.is_char_boundary(at) {
        at += 1;
    }
    let window = &text[at..text.len().min(at + 4096)];
    let space = window
        .char_indices()
        .find(|&(i, c)| c.is_whitespace() && i > 0)
        .map(|(i, _)| at + i);
    space.unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ByteTokenizer;

    #[test]
    fn a_long_text_is_counted_in_pieces_and_stops_past_the_limit() {
        let max = 1000;
        let short = "ab ".repeat(300);
        assert_eq!(count_past(&ByteTokenizer, &short, max).expect("ok"), None);
        let fits = "ab ".repeat(COUNT_PIECE_BYTES);
        assert_eq!(
            count_past(&ByteTokenizer, &fits, fits.len() + 10).expect("ok"),
            None,
            "the byte tokenizer's count over pieces is the text's length"
        );
        let counted = count_past(&ByteTokenizer, &fits, max).expect("ok");
        assert!(
            counted.is_some_and(|n| n > max && n <= COUNT_PIECE_BYTES + 4096),
            "stopped after the first piece: {counted:?}"
        );
    }

    #[test]
    fn pieces_end_before_whitespace_on_char_boundaries() {
        let text = "héllo wörld ".repeat(100);
        let end = piece_end(&text, 7);
        assert!(text.is_char_boundary(end));
        assert!(text[end..].starts_with(' '), "{:?}", &text[end..end + 3]);
        assert_eq!(piece_end("short", 100), 5);
        let no_space = "x".repeat(10_000);
        assert_eq!(piece_end(&no_space, 100), 100);
        let mut rest = text.as_str();
        let mut joined = String::new();
        while !rest.is_empty() {
            let (a, b) = rest.split_at(piece_end(rest, 50));
            joined.push_str(a);
            rest = b;
        }
        assert_eq!(joined, text, "the pieces are the text");
    }
}
