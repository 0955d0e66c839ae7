use std::ffi::CString;
use std::ptr;
use std::rc::Rc;
use std::time::Duration;

use ucx_sys as sys;

use super::error::{check, UcxError, UcxStatus};
use super::request;

/// How a [`Context`] is configured. Options are set with
/// `ucp_config_modify`, so they override the environment for this context
/// only (`UCX_*` variables still apply to anything not named here).
#[derive(Debug, Clone)]
pub struct ContextOptions {
    /// The transport list (`UCX_TLS`), e.g. `"tcp"` or `"posix,sysv,cma"`.
    /// `None` lets UCX choose.
    pub transports: Option<String>,
    /// Let shared-memory transports run with peer error handling
    /// (`MM_ERROR_HANDLING=y`). Without it, UCX silently excludes shared
    /// memory from every endpoint created in peer error mode.
    pub shared_memory_error_handling: bool,
    /// Let `cma` carry gets and puts beside peer error handling, so that
    /// memory the caller registered ([`super::MemoryRegion::map`]) is read
    /// and written one-sidedly over shared memory instead of through the
    /// target's progress. In peer error mode UCX gives `cma` a lane only
    /// when rendezvous is off (UCX 1.20 and later; before, never): this
    /// sets `RNDV_THRESH=inf` where the transport list may hold `cma`, the
    /// loaded UCX is 1.20 or later and the environment does not set
    /// `UCX_RNDV_THRESH`. kvpoll sends no rendezvous message (its
    /// notifications are at most 1 760 bytes), and endpoints keep peer
    /// error mode: a dead peer still fails them (docs/design.md §4).
    /// Default on.
    pub cma_with_error_handling: bool,
    /// Read a lender on the same host with `process_vm_readv` directly,
    /// and offer readers the same, where the transport list may hold
    /// `cma` ([`super::direct`]: one system call for a post's blocks of a
    /// region, from the poller, on every UCX version; the endpoint still
    /// carries everything else and detects the peer's failure). Only host
    /// memory not allocated by UCX is offered; an engine with device
    /// memory registered neither offers nor reads so. Default on.
    pub direct_reads: bool,
    /// Read a lender's regions that UCX allocated in shared memory, and
    /// its lend words, with a copy (a load for a word) from the poller,
    /// through the mapping UCX made of them in this process when it
    /// unpacked their keys (`ucp_rkey_ptr`), instead of posting UCX gets:
    /// the bytes are the same, UCX's get over `posix` or `sysv` copies
    /// from that mapping too, and a read no longer costs a UCX request
    /// and its completion. Host memory only; the endpoint still carries
    /// everything else and detects the peer's failure. Default on.
    pub mapped_reads: bool,
    /// Further `(name, value)` pairs, names without the `UCX_` prefix.
    pub extra: Vec<(String, String)>,
    /// Ask for `UCP_FEATURE_WAKEUP`, so that an idle poller can block on
    /// the worker's event fd and wake on the next network event instead of
    /// napping on a timer. UCX 1.13 keeps `posix`, `sysv`, `cma` and `tcp`
    /// with it (measured: docs/design.md §4). Default on.
    pub wakeup: bool,
    /// UCX's adaptive progress (`ADAPTIVE_PROGRESS`): an interface no
    /// endpoint uses is left out of progress, and its events reach the
    /// worker through UCX's async thread, which then signals the worker's
    /// event fd: two thread wake-ups for a message to an idle poller
    /// instead of one. `None` (the default) lets kvpoll choose: off when
    /// the transport list names only shared-memory transports, where
    /// progressing every interface costs nothing measurable and a lender's
    /// poller then wakes on a notification in ~80 µs instead of ~200 µs
    /// (docs/latency.md); UCX's default (on) otherwise, since with it off
    /// each tcp interface (one per network device) costs a syscall in
    /// every progress, idle or not.
    pub adaptive_progress: Option<bool>,
    /// How often UCX checks that the peer of each endpoint still lives
    /// (`KEEPALIVE_INTERVAL`; over shared memory and `cma`, whether its
    /// process still runs); a peer found dead fails its endpoints. A
    /// write ends only once its puts and their flush completed or failed
    /// (docs/design.md §2), and when a destination dies with its message
    /// queue full (it stopped draining first), what waits behind that
    /// queue fails only at this check: the writer holds its source blocks
    /// until then (kvpoll also checks a peer on its own host itself,
    /// every second: `docs/design.md` §4). UCX's own default is 20 s;
    /// kvpoll's is 1 s where the transport list names only transports
    /// within one host (there the check reads a few bytes of `/proc` per
    /// endpoint; over tcp the dead peer's kernel resets its connections,
    /// and the check was not measured there). Left to UCX where the environment sets
    /// `UCX_KEEPALIVE_INTERVAL`, with `None`, or with a list that may hold
    /// other transports.
    pub keepalive_interval: Option<Duration>,
}

impl Default for ContextOptions {
    fn default() -> Self {
        Self {
            transports: None,
            shared_memory_error_handling: true,
            cma_with_error_handling: true,
            direct_reads: true,
            mapped_reads: true,
            extra: Vec::new(),
            wakeup: true,
            adaptive_progress: None,
            keepalive_interval: Some(KEEPALIVE_INTERVAL),
        }
    }
}

/// kvpoll's default [`ContextOptions::keepalive_interval`].
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);

impl ContextOptions {
    /// Options restricted to the given transport list.
    pub fn with_transports(tls: &str) -> Self {
        Self {
            transports: Some(tls.to_owned()),
            ..Self::default()
        }
    }

    /// Whether the transport list can include a shared-memory (mm) transport;
    /// only then is `MM_ERROR_HANDLING` set (UCX warns about an option that
    /// no selected transport reads).
    pub(crate) fn may_use_shared_memory(&self) -> bool {
        self.may_use(|t| t == "all" || is_mm_transport(t))
    }

    /// Whether the transport list can include `cma`.
    pub(crate) fn may_use_cma(&self) -> bool {
        self.may_use(|t| matches!(t, "all" | "cma" | "sm" | "shm"))
    }

    /// Whether UCX's choice, an exclusion list (`^...`) or a name that
    /// `named` takes can let in the transport asked about.
    fn may_use(&self, named: impl Fn(&str) -> bool) -> bool {
        match &self.transports {
            None => true,
            Some(list) => list.starts_with('^') || list.split(',').any(|t| named(t.trim())),
        }
    }

    /// Whether rendezvous is turned off so that `cma` gets a lane beside
    /// peer error handling (see [`ContextOptions::cma_with_error_handling`]),
    /// on a UCX of `version` with `UCX_RNDV_THRESH` set in the environment
    /// or not.
    fn rendezvous_off_for_cma(&self, version: ucx_sys::Version, env_sets_it: bool) -> bool {
        self.cma_with_error_handling
            && self.may_use_cma()
            && (version.major, version.minor) >= (1, 20)
            && !env_sets_it
    }

    /// The `KEEPALIVE_INTERVAL` to give UCX (in microseconds, at least
    /// 1), if any: none where the environment sets it, or where the
    /// transport list may hold transports between hosts.
    fn keepalive_value(&self, env_sets_it: bool) -> Option<String> {
        let every = self
            .keepalive_interval
            .filter(|_| !env_sets_it && self.same_host_only())?;
        Some(format!("{}us", every.as_micros().max(1)))
    }

    /// Whether the transport list names only transports within one host:
    /// shared memory, `cma`, `knem`, `self`.
    fn same_host_only(&self) -> bool {
        self.names_only(|t| is_mm_transport(t) || matches!(t, "cma" | "knem" | "self"))
    }

    /// Whether the transport list names transports and `named` takes each.
    fn names_only(&self, named: impl Fn(&str) -> bool) -> bool {
        self.transports.as_deref().is_some_and(|list| {
            !list.starts_with('^') && list.split(',').map(str::trim).all(&named)
        })
    }

    /// Whether a context that lets no peer write into its memory goes
    /// without UCX's remote memory access (`UCP_FEATURE_RMA`): where tcp
    /// is the only transport. There UCX emulates a peer's put with a
    /// message its target's worker applies to whatever address it names
    /// (`ucp_put_handler`, `rma_sw.c`, registered or not), and only a
    /// context without the feature installs no handler for it. Such a
    /// context's own reads are kvpoll's messages (soft reads), but it can
    /// post no put: its engine writes nothing either.
    pub(crate) fn without_rma(&self, remote_write: bool) -> bool {
        !remote_write && self.names_only(|t| t == "tcp")
    }

    /// The `ADAPTIVE_PROGRESS` value these options give UCX: the one asked
    /// for, or kvpoll's choice (see [`ContextOptions::adaptive_progress`]);
    /// `None` leaves UCX's own (or the environment's).
    fn adaptive_progress_value(&self) -> Option<&'static str> {
        let on = match self.adaptive_progress {
            Some(on) => on,
            None if self.same_host_only() => false,
            None => return None,
        };
        Some(if on { "y" } else { "n" })
    }

    /// With or without `UCX_ADAPTIVE_PROGRESS` (see
    /// [`ContextOptions::adaptive_progress`]).
    pub fn adaptive_progress(mut self, on: bool) -> Self {
        self.adaptive_progress = Some(on);
        self
    }

    /// With or without direct reads (see [`ContextOptions::direct_reads`]).
    pub fn direct_reads(mut self, on: bool) -> Self {
        self.direct_reads = on;
        self
    }

    /// With or without mapped reads (see [`ContextOptions::mapped_reads`]).
    pub fn mapped_reads(mut self, on: bool) -> Self {
        self.mapped_reads = on;
        self
    }

    /// Whether this engine reads and offers direct reads: asked for, and
    /// a transport list that may hold `cma`.
    pub(crate) fn reads_directly(&self) -> bool {
        self.direct_reads && self.may_use_cma()
    }

    /// With or without `UCP_FEATURE_WAKEUP` (see [`ContextOptions::wakeup`]).
    pub fn wakeup(mut self, on: bool) -> Self {
        self.wakeup = on;
        self
    }

    /// Adds one option (name without the `UCX_` prefix).
    pub fn option(mut self, name: &str, value: &str) -> Self {
        self.extra.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// A shared-memory (mm) transport name or alias, as `UCX_TLS` takes it.
fn is_mm_transport(name: &str) -> bool {
    matches!(name, "mm" | "sm" | "shm" | "posix" | "sysv" | "xpmem")
}

pub(crate) struct ContextInner {
    pub(crate) handle: sys::ucp_context_h,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_init and every worker and memory
        // region holds an Rc to this inner, so nothing uses it any more.
        unsafe { sys::ucp_cleanup(self.handle) }
    }
}

/// A UCP context with the RMA and active-message features (and wake-up,
/// unless turned off).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Rc<ContextInner>,
    wakeup: bool,
    reads_by_cma: bool,
    /// Peers may write into the memory this context registers.
    remote_write: bool,
    /// Created with `UCP_FEATURE_RMA` (see [`ContextOptions::without_rma`]).
    rma: bool,
}

struct Config(*mut sys::ucp_config_t);

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: read by ucp_config_read, released once.
        unsafe { sys::ucp_config_release(self.0) }
    }
}

impl Config {
    /// The defaults plus the `UCX_*` environment variables.
    fn read() -> Result<Self, UcxError> {
        let mut raw = ptr::null_mut();
        // SAFETY: NULL env prefix and filename mean "the defaults plus UCX_*
        // environment variables"; raw receives the new config.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw)
        })?;
        Ok(Config(raw))
    }

    /// `ucp_init` with this config; the caller owns the context.
    fn init(&self, params: &sys::ucp_params_t) -> Result<sys::ucp_context_h, UcxError> {
        let mut handle = ptr::null_mut();
        // SAFETY: params and the config are valid for the call; handle
        // receives the context on success.
        check("ucp_init", unsafe {
            sys::ucp_init(params, self.0, &mut handle)
        })?;
        Ok(handle)
    }

    fn set(&mut self, name: &str, value: &str) -> Result<(), UcxError> {
        let n = CString::new(name).map_err(|_| UcxError::NulInOption(name.to_owned()))?;
        let v = CString::new(value).map_err(|_| UcxError::NulInOption(value.to_owned()))?;
        // SAFETY: the config is live; both strings are NUL-terminated and
        // outlive the call (UCX copies them).
        let status = unsafe { sys::ucp_config_modify(self.0, n.as_ptr(), v.as_ptr()) };
        if status == sys::ucs_status_t::UCS_OK {
            Ok(())
        } else {
            Err(UcxError::BadOption {
                name: name.to_owned(),
                value: value.to_owned(),
                status: UcxStatus(status),
            })
        }
    }
}

/// The transports this UCX can use on this machine (`tcp`, `posix`...),
/// from the resources `ucp_context_print_info` lists for a context with
/// every transport; empty where even that fails.
fn offered_transports() -> Vec<String> {
    let Ok(mut cfg) = Config::read() else {
        return Vec::new();
    };
    let params = sys::ucp_params_t {
        field_mask: sys::UCP_PARAM_FIELD_FEATURES as u64,
        features: features(false, true),
        ..Default::default()
    };
    let Ok(handle) = cfg.set("TLS", "all").and_then(|()| cfg.init(&params)) else {
        return Vec::new();
    };
    let context = ContextInner { handle };
    let mut buf: *mut std::ffi::c_char = ptr::null_mut();
    let mut len = 0;
    // SAFETY: buf and len are valid out-parameters; the stream owns buf
    // until fclose, which sets them to the text written.
    let stream = unsafe { libc::open_memstream(&mut buf, &mut len) };
    if stream.is_null() {
        return Vec::new();
    }
    // SAFETY: the context is live and the stream open; fclose flushes it
    // into buf (NUL-terminated), which is ours to free after.
    let text = unsafe {
        sys::ucp_context_print_info(context.handle, stream.cast());
        libc::fclose(stream);
        let text = std::ffi::CStr::from_ptr(buf).to_string_lossy().into_owned();
        libc::free(buf.cast());
        text
    };
    transports_of(&text)
}

/// The transport names of `ucp_context_print_info`'s resource lines
/// (`#      resource 1  :  md 1  dev 1  flags -- tcp/eth0`), once each.
fn transports_of(info: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in info.lines().filter(|l| l.contains("resource")) {
        let Some((_, tail)) = line.split_once("-- ") else {
            continue;
        };
        let tl = tail.split('/').next().unwrap_or("").trim();
        if !tl.is_empty() && !out.iter().any(|t| t == tl) {
            out.push(tl.to_owned());
        }
    }
    out
}

/// Refuses a loaded UCX older than the one built against
/// ([`UcxError::IncompatibleVersion`]).
pub fn check_version() -> Result<(), UcxError> {
    let (built, runtime) = (ucx_sys::Version::built(), ucx_sys::Version::runtime());
    if runtime.runs_code_built_for(built) {
        Ok(())
    } else {
        Err(UcxError::IncompatibleVersion {
            runtime,
            built,
            libdir: ucx_sys::BUILT_LIBDIR,
        })
    }
}

/// Failures inside the UCX loaded in this process that kvpoll cannot
/// catch (each aborts a process from inside UCX's progress), as measured
/// on the releases kvpoll is tested with (docs/design.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownUcxLimits {
    /// Over tcp, a put's target aborts when its writer dies mid-put
    /// (`ucp_put_handler`: "Fatal: unexpected error: Endpoint timeout").
    pub tcp_target_dies_with_its_writer: bool,
}

impl KnownUcxLimits {
    /// Those of UCX `version`: the writer's before 1.22 (seen on 1.13).
    /// (Over tcp UCX's emulated get aborts its lender when the reader dies
    /// on every release kvpoll supports, 1.13 and 1.22 alike: kvpoll's
    /// transport never uses it there, see `soft.rs`.)
    pub fn of(version: ucx_sys::Version) -> Self {
        Self {
            tcp_target_dies_with_its_writer: (version.major, version.minor) < (1, 22),
        }
    }

    /// Those of the UCX loaded in this process.
    pub fn loaded() -> Self {
        Self::of(ucx_sys::Version::runtime())
    }
}

/// One line on the UCX in use: the version loaded (as UCX reports it),
/// the one built against and where from, and whether the two go together,
/// e.g. `UCX 1.22.0 (built against 1.22.0, wheel: /venv/.../libucx/lib)`.
pub fn version_line() -> String {
    let (built, runtime) = (ucx_sys::Version::built(), ucx_sys::Version::runtime());
    let verdict = if runtime.runs_code_built_for(built) {
        ""
    } else {
        ": INCOMPATIBLE, engines refuse to start"
    };
    format!(
        "UCX {runtime} (built against {}, {}: {}){verdict}",
        ucx_sys::BUILT_VERSION,
        ucx_sys::BUILT_SOURCE,
        ucx_sys::BUILT_LIBDIR
    )
}

fn features(wakeup: bool, rma: bool) -> u64 {
    let mut features = sys::UCP_FEATURE_AM;
    if rma {
        features |= sys::UCP_FEATURE_RMA;
    }
    if wakeup {
        features |= sys::UCP_FEATURE_WAKEUP;
    }
    u64::from(features)
}

impl Context {
    /// Creates a context with the given options, whose memory peers may
    /// write into.
    pub fn new(options: &ContextOptions) -> Result<Self, UcxError> {
        Self::open(options, true)
    }

    /// Creates a context with the given options; `remote_write`: whether
    /// peers may write into the memory it registers
    /// ([`crate::engine::EngineBuilder::remote_write`]).
    pub(crate) fn open(options: &ContextOptions, remote_write: bool) -> Result<Self, UcxError> {
        check_version()?;
        let rma = !options.without_rma(remote_write);
        let mut cfg = Config::read()?;
        if let Some(tls) = &options.transports {
            cfg.set("TLS", tls)?;
        }
        if options.shared_memory_error_handling && options.may_use_shared_memory() {
            cfg.set("MM_ERROR_HANDLING", "y")?;
        }
        if let Some(v) = options.adaptive_progress_value() {
            cfg.set("ADAPTIVE_PROGRESS", v)?;
        }
        // In peer error mode UCX 1.20+ asks a high-bandwidth RMA lane for
        // memory invalidation only while rendezvous is on
        // (`ucp_wireup_add_rma_bw_lanes`), and cma has none.
        let reads_by_cma = options.rendezvous_off_for_cma(
            ucx_sys::Version::runtime(),
            std::env::var_os("UCX_RNDV_THRESH").is_some(),
        );
        if reads_by_cma {
            cfg.set("RNDV_THRESH", "inf")?;
        }
        if let Some(every) =
            options.keepalive_value(std::env::var_os("UCX_KEEPALIVE_INTERVAL").is_some())
        {
            cfg.set("KEEPALIVE_INTERVAL", &every)?;
        }
        for (name, value) in &options.extra {
            cfg.set(name, value)?;
        }
        // Last, over the environment and `extra`: in unified mode a worker
        // address leaves out the lengths that kvpoll checks a peer's address
        // by (layout.rs), taking them from the local interfaces instead.
        cfg.set("UNIFIED_MODE", "n")?;

        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES
                | sys::UCP_PARAM_FIELD_REQUEST_SIZE
                | sys::UCP_PARAM_FIELD_REQUEST_INIT) as u64,
            features: features(options.wakeup, rma),
            request_size: request::REQUEST_SIZE,
            request_init: Some(request::request_init),
            ..Default::default()
        };
        let handle = match cfg.init(&params) {
            // No transport of the list is usable here: say which exist.
            Err(UcxError::Call { status, .. })
                if status.0 == sys::ucs_status_t::UCS_ERR_NO_DEVICE =>
            {
                return Err(UcxError::NoUsableTransport {
                    asked: options
                        .transports
                        .clone()
                        .unwrap_or_else(|| "(UCX's default)".into()),
                    offered: offered_transports().join(", "),
                })
            }
            other => other?,
        };
        Ok(Self {
            inner: Rc::new(ContextInner { handle }),
            wakeup: options.wakeup,
            reads_by_cma,
            remote_write,
            rma,
        })
    }

    /// Whether this context turned rendezvous off so that cma serves gets
    /// and puts on one host (UCX ≥ 1.20 with cma in the transport list;
    /// see [`ContextOptions::cma_with_error_handling`]). Every one-sided
    /// operation between processes then goes through cma, UCX-allocated
    /// memory included, and moves faster from huge pages.
    pub fn reads_by_cma(&self) -> bool {
        self.reads_by_cma
    }

    /// Whether peers may write into the memory this context registers.
    pub fn allows_remote_write(&self) -> bool {
        self.remote_write
    }

    /// Whether the context can post gets and puts (`UCP_FEATURE_RMA`):
    /// not where it lets no peer write over tcp alone
    /// ([`ContextOptions::without_rma`]).
    pub fn has_rma(&self) -> bool {
        self.rma
    }

    /// Whether the context was created with `UCP_FEATURE_WAKEUP` (its
    /// workers have an event fd).
    pub fn has_wakeup(&self) -> bool {
        self.wakeup
    }

    /// The memory types this UCX can register and move, as a bit mask of
    /// `1 << ucs_memory_type` (`UCS_MEMORY_TYPE_HOST` always; CUDA, ROCm…
    /// only when UCX was built with them and their transports loaded).
    pub fn memory_types(&self) -> Result<u64, UcxError> {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64,
            ..Default::default()
        };
        // SAFETY: the context is live; attr is a valid out-parameter whose
        // field_mask asks only for memory_types.
        check("ucp_context_query", unsafe {
            sys::ucp_context_query(self.inner.handle, &mut attr)
        })?;
        Ok(attr.memory_types)
    }

    /// Whether this UCX can register CUDA device memory.
    pub fn supports_cuda(&self) -> Result<bool, UcxError> {
        Ok(self.memory_types()? & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::ContextOptions;
    use std::time::Duration;

    #[test]
    fn the_transports_offered_are_read_from_the_resource_lines_once_each() {
        let info = "#            md 1  :  component 1  tcp \n\
                    #      resource 0  :  md 0  dev 0  flags -- self/memory0\n\
                    #      resource 1  :  md 1  dev 1  flags -- tcp/eth0\n\
                    #      resource 2  :  md 1  dev 2  flags -- tcp/lo\n\
                    #      resource 3  :  md 2  dev 3  flags -- posix/memory\n";
        assert_eq!(super::transports_of(info), ["self", "tcp", "posix"]);
    }

    #[test]
    fn adaptive_progress_is_off_for_shared_memory_lists_and_left_to_ucx_otherwise() {
        let value = |o: ContextOptions| o.adaptive_progress_value();
        for shm in [
            "posix,sysv,cma",
            "posix",
            "sysv, cma",
            "sm,self",
            "posix,sysv,cma,knem",
        ] {
            assert_eq!(
                value(ContextOptions::with_transports(shm)),
                Some("n"),
                "{shm}"
            );
        }
        // Lists that can include tcp (or anything else), and UCX's own
        // choice: UCX's default (each tcp interface would cost a syscall
        // per progress with it off).
        for other in ["tcp", "posix,sysv,cma,tcp", "^tcp", "all", "rc,sm"] {
            assert_eq!(
                value(ContextOptions::with_transports(other)),
                None,
                "{other}"
            );
        }
        assert_eq!(value(ContextOptions::default()), None);
        // Asked for: given to UCX whatever the list.
        let tcp = ContextOptions::with_transports("tcp");
        assert_eq!(value(tcp.clone().adaptive_progress(false)), Some("n"));
        assert_eq!(value(tcp.adaptive_progress(true)), Some("y"));
        assert_eq!(
            value(ContextOptions::with_transports("posix").adaptive_progress(true)),
            Some("y")
        );
    }

    #[test]
    fn peers_on_this_host_are_checked_every_second_unless_the_environment_or_the_caller_says_otherwise(
    ) {
        let o = ContextOptions::with_transports("posix,sysv,cma");
        assert_eq!(o.keepalive_value(false).as_deref(), Some("1000000us"));
        assert_eq!(
            o.keepalive_value(true),
            None,
            "the environment's value stands"
        );
        for other in ["tcp", "posix,sysv,cma,tcp", "^tcp", "all"] {
            let o = ContextOptions::with_transports(other);
            assert_eq!(o.keepalive_value(false), None, "{other}: UCX's own");
        }
        assert_eq!(ContextOptions::default().keepalive_value(false), None);
        let every = |d| ContextOptions {
            keepalive_interval: d,
            ..ContextOptions::with_transports("posix")
        };
        assert_eq!(
            every(Some(Duration::from_millis(250)))
                .keepalive_value(false)
                .as_deref(),
            Some("250000us")
        );
        assert_eq!(
            every(Some(Duration::ZERO))
                .keepalive_value(false)
                .as_deref(),
            Some("1us"),
            "UCX refuses 0"
        );
        assert_eq!(every(None).keepalive_value(false), None, "UCX's own");
    }

    #[test]
    fn rendezvous_is_turned_off_for_cma_only_where_ucx_then_gives_cma_a_lane() {
        let v = |major, minor| ucx_sys::Version {
            major,
            minor,
            patch: 0,
        };
        let shm = ContextOptions::with_transports("posix,sysv,cma");
        assert!(shm.rendezvous_off_for_cma(v(1, 22), false));
        assert!(shm.rendezvous_off_for_cma(v(1, 20), false));
        assert!(ContextOptions::default().rendezvous_off_for_cma(v(1, 22), false));
        assert!(ContextOptions::with_transports("sm").rendezvous_off_for_cma(v(1, 22), false));
        // Before 1.20 it gives cma no lane in peer error mode either way.
        assert!(!shm.rendezvous_off_for_cma(v(1, 13), false));
        assert!(!shm.rendezvous_off_for_cma(v(1, 19), false));
        // The environment's value stands; no cma in the list, or asked not to.
        assert!(!shm.rendezvous_off_for_cma(v(1, 22), true));
        for other in ["tcp", "posix,sysv", "tcp,posix"] {
            let o = ContextOptions::with_transports(other);
            assert!(!o.rendezvous_off_for_cma(v(1, 22), false), "{other}");
        }
        let off = ContextOptions {
            cma_with_error_handling: false,
            ..shm
        };
        assert!(!off.rendezvous_off_for_cma(v(1, 22), false));
    }
}
