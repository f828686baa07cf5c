//! What the routes read about the engines: the live endpoint set ([`endpoints`], from the config's
//! list or [`discovery`]), the router's own load accounting ([`load`]), scraped metrics and health
//! checks ([`scrape`]), and the prefix index fed by the engines' KV events ([`prefix`] is the
//! lookup the routes use; [`feed`] and [`indexer`] subscribe to the events and apply them).

pub mod discovery;
pub mod endpoints;
pub(crate) mod feed;
pub mod indexer;
pub mod load;
pub mod prefix;
pub mod scrape;
