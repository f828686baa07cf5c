//! The HTTP surface: the axum app ([`app`]: OpenAI endpoints, `/health`, `/metrics`, `/debug/*`),
//! each request parsed once ([`request`]) with the tokenizer that cuts prompts as the engines do
//! ([`tokenizer`]). From here a request goes to the aggregated route or, with `pd:`, the P/D
//! route.

pub mod app;
pub mod request;
pub(crate) mod tokenizer;
