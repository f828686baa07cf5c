//! A byte-level tokenizer: token `i < 256` is byte `i`; ids 256.. are specials. Deterministic and
//! shared by router and `sim` engines so both cut the same text into the same blocks.

use kvmesh_core::TokenId;

use crate::{ChatMessage, TextError, Tokenizer};

/// Byte-level tokenizer with a ChatML-like template.
#[derive(Debug, Clone, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// End of sequence.
    pub const EOS: TokenId = 256;
    pub const VOCAB_SIZE: usize = 257;
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, TextError> {
        Ok(text.bytes().map(TokenId::from).collect())
    }

    fn max_text_bytes_per_token(&self) -> usize {
        1
    }

    fn decode(&self, tokens: &[TokenId]) -> Result<String, TextError> {
        let bytes: Vec<u8> = tokens
            .iter()
            .filter_map(|&t| u8::try_from(t).ok())
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn token_str(&self, token: TokenId) -> String {
        match u8::try_from(token) {
            Ok(b) => String::from_utf8_lossy(&[b]).into_owned(),
            Err(_) if token == Self::EOS => "<eos>".to_owned(),
            Err(_) => format!("<{token}>"),
        }
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let mut out = String::new();
        for m in messages {
            out.push_str("<|im_start|>");
            out.push_str(&m.role);
            out.push('\n');
            out.push_str(&m.content);
            out.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        Ok(out)
    }

    fn eos_token_ids(&self) -> Vec<TokenId> {
        vec![Self::EOS]
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_utf8_text() {
        let t = ByteTokenizer;
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids.len(), 6);
        assert_eq!(t.decode(&ids).unwrap(), "héllo");
    }
}
