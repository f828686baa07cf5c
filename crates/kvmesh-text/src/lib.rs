//! The text side of serving: turning prompts and chat messages into token ids and back.
//!
//! [`Tokenizer`] is what the engine and the router need; implementations: [`ByteTokenizer`]
//! (deterministic, dependency-free, used by the `sim` backend and tests), a HF `tokenizer.json`
//! tokenizer found in a model directory as transformers / vLLM find it ([`HfTokenizer::load`],
//! [`TokenizerFiles`]) and a GGUF-vocabulary tokenizer (real models). Chat templates render OpenAI
//! messages to a prompt string.

use std::borrow::Cow;

mod byte;
mod count;
mod hf;
mod model_dir;
mod template;

pub use byte::ByteTokenizer;
pub use count::{COUNT_IN_PIECES_ABOVE, COUNT_PIECE_BYTES, count_past};
pub use hf::{GgufVocab, HfTokenizer};
use kvmesh_core::TokenId;
pub use model_dir::TokenizerFiles;
use serde::{Deserialize, Serialize};
pub use template::{ChatTemplate, SpecialTokens};

/// One OpenAI chat message (content flattened to text). Borrowed where the caller can lend its
/// text (a request body's own bytes), so rendering is the only copy of a large message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage<'a> {
    pub role: Cow<'a, str>,
    pub content: Cow<'a, str>,
}

/// Errors from tokenization or template rendering.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
}

/// Text ↔ token ids for one model, plus its chat template.
pub trait Tokenizer: Send + Sync {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, TextError>;
    fn decode(&self, tokens: &[TokenId]) -> Result<String, TextError>;
    /// The display string of one token (for `/tokenize`'s `token_strs`).
    fn token_str(&self, token: TokenId) -> String;
    /// Renders chat messages to the prompt text the model expects.
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError>;
    /// End-of-sequence token ids.
    fn eos_token_ids(&self) -> Vec<TokenId>;
    fn vocab_size(&self) -> usize;
    /// At most how many bytes of input text one token stands for, so that a text of `n` bytes
    /// has at least `n / max_text_bytes_per_token()` tokens. Lets a caller refuse an over-long
    /// prompt before encoding it: token ids take 4 bytes each, text often 1 to 4 per token.
    fn max_text_bytes_per_token(&self) -> usize;
}
