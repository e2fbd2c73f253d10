//! Generated workloads: each request's content drawn from a model of real traffic and a seed.
//!
//! [`PrefixScenario`] models what makes prefix-cache routing matter: tenants, each with its own
//! long system prompt, whose popularity follows a Zipf law, and multi-turn conversations whose
//! prompt grows turn by turn (system prompt + earlier turns + the new user message). The same
//! seed gives the same sequence of requests, whatever the target answers: request `i` of two
//! runs is the same body, so several routers can be compared on one workload.

use anyhow::{Context as _, bail, ensure};
use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use serde::{Deserialize, Serialize};

/// Bytes of text per token: the mock engine counts `ceil(bytes / 4)` tokens of the rendered
/// chat, and English text runs about four bytes a token under real tokenizers.
pub const BYTES_PER_TOKEN: usize = 4;

/// Most tenants a scenario may have.
pub const MAX_TENANTS: u32 = 100_000;
/// Largest system prompt, in tokens.
pub const MAX_SYSTEM_TOKENS: u32 = 1_000_000;

/// A generated workload (`--scenario FILE`): a YAML or JSON map with one key naming the kind,
/// e.g. `prefix: {tenants: 64, zipf_s: 1.1}`. Unknown keys are rejected.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scenario {
    /// Multi-tenant shared prefixes and multi-turn conversations.
    Prefix(PrefixScenario),
}

impl Scenario {
    /// Checks every bound; the error names the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        match self {
            Self::Prefix(p) => p.validate(),
        }
    }

    /// Whether the answers are streamed.
    pub fn stream(&self) -> bool {
        match self {
            Self::Prefix(p) => p.stream,
        }
    }
}

impl std::fmt::Display for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Prefix(p) => p.fmt(f),
        }
    }
}

/// A scenario file: one key per kind (YAML maps an enum to tags, not to keys, hence the struct).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    prefix: Option<PrefixScenario>,
}

/// Reads a scenario file (YAML or JSON).
pub fn parse_scenario(text: &str) -> anyhow::Result<Scenario> {
    let file: ScenarioFile = serde_yaml_ng::from_str(text).context("invalid scenario")?;
    let scenario = match file {
        ScenarioFile { prefix: Some(p) } => Scenario::Prefix(p),
        ScenarioFile { prefix: None } => bail!("the scenario names no kind (prefix: {{...}})"),
    };
    scenario.validate()?;
    Ok(scenario)
}

/// Tenants with their own system prompts, picked by Zipf popularity, each with a few
/// conversations open at once that grow turn by turn.
///
/// Each request: a tenant drawn by Zipf(`zipf_s`) over `tenants` (tenant 0 the most popular),
/// then one of that tenant's `conversations_per_tenant` open conversations, uniformly; the
/// request is that conversation's next turn: the tenant's system prompt, the earlier turns
/// (user messages of `turn_bytes` and answers of `answer_bytes`, the answers as the client
/// would keep them) and a new user message. After `turns` turns the conversation is replaced by
/// a new one. Token counts are bytes / [`BYTES_PER_TOKEN`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixScenario {
    /// Tenants, each with its own system prompt.
    pub tenants: u32,
    /// Smallest system prompt, in tokens (each tenant's size drawn uniformly from the range).
    pub system_tokens_min: u32,
    /// Largest system prompt, in tokens.
    pub system_tokens_max: u32,
    /// Exponent of the Zipf law of tenant popularity (0: all alike; 1: the classic law).
    pub zipf_s: f64,
    /// Turns per conversation.
    pub turns: u32,
    /// Conversations each tenant has open at once.
    pub conversations_per_tenant: u32,
    /// Bytes of each user message.
    pub turn_bytes: usize,
    /// Bytes of each earlier answer carried in the conversation.
    pub answer_bytes: usize,
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// Stream the answers (with `stream_options.include_usage`).
    pub stream: bool,
    /// Send the conversation's id in the OpenAI `user` field (a session hint for routers).
    pub session_hint: bool,
}

impl Default for PrefixScenario {
    fn default() -> Self {
        Self {
            tenants: 64,
            system_tokens_min: 1000,
            system_tokens_max: 6000,
            zipf_s: 1.0,
            turns: 4,
            conversations_per_tenant: 4,
            turn_bytes: 512,
            answer_bytes: 256,
            max_tokens: 32,
            stream: true,
            session_hint: false,
        }
    }
}

impl PrefixScenario {
    fn validate(&self) -> anyhow::Result<()> {
        ensure!(
            (1..=MAX_TENANTS).contains(&self.tenants),
            "prefix.tenants must be between 1 and {MAX_TENANTS}"
        );
        ensure!(
            self.system_tokens_min <= self.system_tokens_max,
            "prefix.system_tokens_min is above system_tokens_max"
        );
        ensure!(
            self.system_tokens_max <= MAX_SYSTEM_TOKENS,
            "prefix.system_tokens_max is above {MAX_SYSTEM_TOKENS}"
        );
        ensure!(
            self.zipf_s.is_finite() && self.zipf_s >= 0.0,
            "prefix.zipf_s must be a number >= 0"
        );
        ensure!(
            (1..=10_000).contains(&self.turns),
            "prefix.turns must be between 1 and 10000"
        );
        ensure!(
            (1..=10_000).contains(&self.conversations_per_tenant),
            "prefix.conversations_per_tenant must be between 1 and 10000"
        );
        ensure!(
            self.turn_bytes <= 1 << 20 && self.answer_bytes <= 1 << 20,
            "prefix.turn_bytes and answer_bytes must be at most 1 MiB"
        );
        Ok(())
    }
}

impl std::fmt::Display for PrefixScenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "prefix: {} tenants, system prompts {}-{} tokens, zipf s={}, {} conversations/tenant \
             of {} turns ({} B asked, {} B answered), max_tokens={}",
            self.tenants,
            self.system_tokens_min,
            self.system_tokens_max,
            self.zipf_s,
            self.conversations_per_tenant,
            self.turns,
            self.turn_bytes,
            self.answer_bytes,
            self.max_tokens
        )?;
        if self.stream {
            write!(f, " stream")?;
        }
        if self.session_hint {
            write!(f, " session-hint")?;
        }
        Ok(())
    }
}

/// One generated request.
#[derive(Clone, Debug)]
pub struct Drawn {
    /// The tenant (0 is the most popular).
    pub tenant: u32,
    /// The conversation's id, unique in the run (also the `user` of a session hint, as
    /// `t{tenant}-c{conversation}`).
    pub conversation: u64,
    /// The turn in the conversation, from 0.
    pub turn: u32,
    /// The JSON body of `POST /chat/completions`.
    pub body: Bytes,
    /// Bytes of message text in the body (system prompt and every message).
    pub text_bytes: usize,
}

/// An open conversation of a tenant: its id and the turns already sent.
#[derive(Clone, Copy, Debug)]
struct Open {
    id: u64,
    sent: u32,
}

/// Draws the requests of a [`PrefixScenario`], in order. Deterministic: the same scenario, model
/// and seed give the same sequence.
#[derive(Debug)]
pub struct PrefixGenerator {
    scenario: PrefixScenario,
    model: String,
    seed: u64,
    /// Each tenant's system prompt.
    systems: Vec<String>,
    /// Cumulative Zipf probabilities, by tenant.
    cdf: Vec<f64>,
    rng: SmallRng,
    /// Each tenant's open conversations (`None`: none yet in that slot).
    open: Vec<Vec<Option<Open>>>,
    next_id: u64,
}

impl PrefixGenerator {
    /// The generator of `scenario` for `model`, seeded with `seed`. Builds every tenant's system
    /// prompt at once (tenants × average size of memory).
    pub fn new(scenario: &PrefixScenario, model: &str, seed: u64) -> anyhow::Result<Self> {
        scenario.validate()?;
        let mut sizes = SmallRng::seed_from_u64(mix(seed, 0x5157_E35E));
        let systems = (0..scenario.tenants)
            .map(|t| {
                let tokens =
                    sizes.random_range(scenario.system_tokens_min..=scenario.system_tokens_max);
                let head = format!("You are the assistant of tenant {t}. Follow these rules. ");
                text(
                    &head,
                    tokens as usize * BYTES_PER_TOKEN,
                    mix(seed, u64::from(t)),
                )
            })
            .collect();
        Ok(Self {
            cdf: zipf_cdf(scenario.tenants, scenario.zipf_s),
            open: vec![
                vec![None; scenario.conversations_per_tenant as usize];
                scenario.tenants as usize
            ],
            scenario: scenario.clone(),
            model: model.to_owned(),
            seed,
            systems,
            rng: SmallRng::seed_from_u64(seed),
            next_id: 0,
        })
    }

    /// The system prompt of `tenant`.
    pub fn system_prompt(&self, tenant: u32) -> Option<&str> {
        self.systems.get(tenant as usize).map(String::as_str)
    }

    /// The next request.
    pub fn next_request(&mut self) -> anyhow::Result<Drawn> {
        let u: f64 = self.rng.random();
        let tenant = self
            .cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len().saturating_sub(1));
        let slots = &mut self.open[tenant];
        let slot = self.rng.random_range(0..slots.len());
        let conv = match slots[slot] {
            Some(c) if c.sent < self.scenario.turns => c,
            _ => {
                self.next_id += 1;
                Open {
                    id: self.next_id,
                    sent: 0,
                }
            }
        };
        slots[slot] = Some(Open {
            id: conv.id,
            sent: conv.sent + 1,
        });
        let tenant = u32::try_from(tenant).context("tenant index")?;
        self.render(tenant, conv.id, conv.sent)
    }

    /// The body of turn `turn` of conversation `id` of `tenant`.
    fn render(&self, tenant: u32, id: u64, turn: u32) -> anyhow::Result<Drawn> {
        let s = &self.scenario;
        let system = self.system_prompt(tenant).context("tenant out of range")?;
        let name = format!("t{tenant}-c{id}");
        let mut owned = Vec::with_capacity(2 * turn as usize + 1);
        for k in 0..=turn {
            let key = mix(mix(self.seed, id), u64::from(k));
            owned.push((
                "user",
                text(&format!("[{name} turn {k}] "), s.turn_bytes, key),
            ));
            if k < turn {
                owned.push((
                    "assistant",
                    text(&format!("[answer {k}] "), s.answer_bytes, !key),
                ));
            }
        }
        let mut messages = Vec::with_capacity(owned.len() + 1);
        messages.push(Message {
            role: "system",
            content: system,
        });
        messages.extend(owned.iter().map(|(role, content)| Message {
            role,
            content: content.as_str(),
        }));
        let text_bytes = messages.iter().map(|m| m.content.len()).sum();
        let body = ChatBody {
            model: &self.model,
            messages,
            max_tokens: s.max_tokens,
            stream: s.stream.then_some(true),
            stream_options: s.stream.then_some(StreamOptions {
                include_usage: true,
            }),
            user: s.session_hint.then_some(name.as_str()),
        };
        Ok(Drawn {
            tenant,
            conversation: id,
            turn,
            body: Bytes::from(serde_json::to_vec(&body)?),
            text_bytes,
        })
    }
}

#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: Vec<Message<'a>>,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// Cumulative probabilities of Zipf(`s`) over `n` ranks (rank 1 at index 0): P(k) ∝ 1 / k^s.
pub fn zipf_cdf(n: u32, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (1..=n).map(|k| f64::from(k).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect();
    if let Some(last) = cdf.last_mut() {
        *last = 1.0;
    }
    cdf
}

/// `head` followed by words drawn from `key`, cut to exactly `len` bytes (ASCII).
fn text(head: &str, len: usize, key: u64) -> String {
    const WORDS: [&str; 32] = [
        "the", "model", "answers", "every", "question", "with", "care", "and", "cites", "its",
        "sources", "when", "asked", "about", "orders", "refunds", "shipping", "accounts", "in",
        "plain", "words", "never", "guess", "prices", "keep", "replies", "short", "polite",
        "escalate", "billing", "issues", "promptly",
    ];
    let mut rng = SmallRng::seed_from_u64(key);
    let mut s = String::with_capacity(len + 16);
    s.push_str(head);
    while s.len() < len {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        s.push(' ');
    }
    s.truncate(len);
    s
}

/// Mixes two numbers into a well-spread 64-bit key (SplitMix64's finaliser).
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
