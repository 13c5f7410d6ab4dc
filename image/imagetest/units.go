// Package imagetest checks a built Berth node image's root tree without booting it. It reads systemd
// units the way systemd does (unit search path, drop-ins, list resets) and reports every binary,
// file, directory or unit they reference that the tree lacks. Its tests run the checks against the
// tree `make image` builds (BERTH_IMAGE_ROOT) and against small synthetic trees.
package imagetest

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
)

// unitDirs is systemd's search path for system units, highest priority first.
var unitDirs = []string{
	"/etc/systemd/system",
	"/run/systemd/system",
	"/usr/local/lib/systemd/system",
	"/usr/lib/systemd/system",
	"/lib/systemd/system",
}

// execSearchPath is where systemd looks for a command given without a directory.
var execSearchPath = []string{"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}

// ErrUnitNotFound is returned by LoadUnit when no unit file of that name is in the tree.
var ErrUnitNotFound = errors.New("unit file not found")

// Unit is a unit file with its drop-ins applied.
type Unit struct {
	// Name is the unit's name, such as kubelet.service.
	Name string
	// Files are the files read, root-relative: the unit file first, then its drop-ins in order.
	Files []string
	// settings maps section, then key, to the values in effect.
	settings map[string]map[string][]string
}

// Values returns the values of a setting in effect after every assignment and reset (an empty
// assignment clears what came before it, as for systemd's list settings).
func (u *Unit) Values(section, key string) []string {
	return u.settings[section][key]
}

// LoadUnit reads the unit name from the tree at root: the first unit file on systemd's search path,
// then the name.d/*.conf drop-ins of every search directory, a drop-in in a higher-priority
// directory hiding one of the same file name in a lower one.
func LoadUnit(root, name string) (*Unit, error) {
	u := &Unit{Name: name, settings: map[string]map[string][]string{}}
	main := ""
	for _, dir := range unitDirs {
		for _, candidate := range unitFileCandidates(name) {
			p := path.Join(dir, candidate)
			if _, err := statIn(root, p); err == nil {
				main = p
				break
			}
		}
		if main != "" {
			break
		}
	}
	if main == "" {
		return nil, fmt.Errorf("loading %s: %w", name, ErrUnitNotFound)
	}
	if err := u.parseFile(root, main); err != nil {
		return nil, err
	}

	dropins := map[string]string{}
	for i := len(unitDirs) - 1; i >= 0; i-- {
		dir := path.Join(unitDirs[i], name+".d")
		entries, err := readDirIn(root, dir)
		if err != nil {
			return nil, err
		}
		for _, e := range entries {
			if strings.HasSuffix(e, ".conf") {
				dropins[e] = path.Join(dir, e)
			}
		}
	}
	names := make([]string, 0, len(dropins))
	for n := range dropins {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if err := u.parseFile(root, dropins[n]); err != nil {
			return nil, err
		}
	}
	return u, nil
}

// unitFileCandidates lists the file names that can define a unit: the name itself and, for a
// template instance such as getty@tty1.service, its template getty@.service.
func unitFileCandidates(name string) []string {
	out := []string{name}
	if at := strings.Index(name, "@"); at >= 0 {
		if dot := strings.LastIndex(name, "."); dot > at+1 {
			out = append(out, name[:at+1]+name[dot:])
		}
	}
	return out
}

func (u *Unit) parseFile(root, p string) error {
	real, err := resolveIn(root, p)
	if err != nil {
		return fmt.Errorf("reading %s: %w", p, err)
	}
	f, err := os.Open(real)
	if err != nil {
		return fmt.Errorf("reading %s: %w", p, err)
	}
	defer f.Close()
	u.Files = append(u.Files, p)

	section := ""
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	lineNo := 0
	pending := ""
	for sc.Scan() {
		lineNo++
		line := strings.TrimSpace(sc.Text())
		if pending == "" && (line == "" || line[0] == '#' || line[0] == ';') {
			continue
		}
		if pending != "" && line != "" && (line[0] == '#' || line[0] == ';') {
			// Comment lines inside a continued assignment are skipped.
			continue
		}
		if strings.HasSuffix(line, "\\") {
			pending += strings.TrimSuffix(line, "\\") + " "
			continue
		}
		line = pending + line
		pending = ""
		if strings.HasPrefix(line, "[") {
			if !strings.HasSuffix(line, "]") {
				return fmt.Errorf("parsing %s:%d: malformed section header", p, lineNo)
			}
			section = line[1 : len(line)-1]
			continue
		}
		key, value, ok := strings.Cut(line, "=")
		if !ok {
			return fmt.Errorf("parsing %s:%d: want KEY=VALUE", p, lineNo)
		}
		if section == "" {
			return fmt.Errorf("parsing %s:%d: assignment outside a section", p, lineNo)
		}
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if u.settings[section] == nil {
			u.settings[section] = map[string][]string{}
		}
		if value == "" {
			u.settings[section][key] = nil
			continue
		}
		u.settings[section][key] = append(u.settings[section][key], value)
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading %s: %w", p, err)
	}
	if pending != "" {
		return fmt.Errorf("parsing %s: file ends inside a continued line", p)
	}
	return nil
}

// Problem is one reference of a unit that the tree cannot satisfy.
type Problem struct {
	// Unit is the unit that holds the reference.
	Unit string
	// Key is the setting, for example ExecStart or EnvironmentFile; for a variable in an
	// environment file, EnvironmentFile:NAME.
	Key string
	// Value is the path or unit name referenced.
	Value string
	// Reason says what is wrong with it.
	Reason string
}

func (p Problem) String() string {
	return fmt.Sprintf("%s: %s=%s: %s", p.Unit, p.Key, p.Value, p.Reason)
}

var execKeys = []string{"ExecCondition", "ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost"}

var pathListKeys = []string{"ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths"}

var dependencyKeys = map[string][]string{
	"Unit":    {"Wants", "Requires", "Requisite", "BindsTo", "PartOf", "Upholds", "Conflicts", "Before", "After", "OnFailure", "OnSuccess"},
	"Install": {"WantedBy", "RequiredBy", "Also"},
}

// CheckUnits loads each named unit from the tree at root and returns the problems found in all of
// them: commands that are not executable files, environment files, sandbox paths and working
// directories that do not exist (unless marked optional with "-", created at run time by the
// unit's RuntimeDirectory= or a tmpfiles.d entry in the tree, or inside /proc, /sys or /dev, which
// the kernel fills at run time and the tree cannot show), units named in dependencies that the
// tree does not have, and *_PATH variables in required environment files that are not executable.
// A unit that cannot be found or parsed is itself a problem; err is reserved for failures to read
// the tree.
func CheckUnits(root string, names ...string) ([]Problem, error) {
	tmpfiles, err := ReadTmpfiles(root)
	if err != nil {
		return nil, err
	}
	var problems []Problem
	for _, name := range names {
		u, err := LoadUnit(root, name)
		if errors.Is(err, ErrUnitNotFound) {
			problems = append(problems, Problem{Unit: name, Key: "unit", Value: name, Reason: "no unit file on the search path"})
			continue
		}
		if err != nil {
			return nil, err
		}
		ps, err := checkUnit(root, u, tmpfiles)
		if err != nil {
			return nil, err
		}
		problems = append(problems, ps...)
	}
	return problems, nil
}

func checkUnit(root string, u *Unit, tmpfiles []TmpfilesEntry) ([]Problem, error) {
	var problems []Problem
	add := func(key, value, reason string) {
		problems = append(problems, Problem{Unit: u.Name, Key: key, Value: value, Reason: reason})
	}

	for _, key := range execKeys {
		for _, v := range u.Values("Service", key) {
			cmd := commandPath(v)
			switch {
			case cmd == "":
				add(key, v, "no command")
			case strings.ContainsAny(cmd, "$%"):
				add(key, cmd, "command path uses a variable or specifier, which cannot be checked")
			default:
				if reason := checkExecutable(root, cmd); reason != "" {
					add(key, cmd, reason)
				}
			}
		}
	}

	provided := runtimeProvided(u, tmpfiles)
	for _, v := range u.Values("Service", "EnvironmentFile") {
		p, optional := strings.CutPrefix(v, "-")
		if optional {
			continue
		}
		if reason := checkExists(root, p, provided, false); reason != "" {
			add("EnvironmentFile", p, reason)
			continue
		}
		if provided[p] {
			continue
		}
		ps, err := checkEnvironmentFile(root, u.Name, p)
		if err != nil {
			return nil, err
		}
		problems = append(problems, ps...)
	}

	for _, key := range pathListKeys {
		for _, v := range u.Values("Service", key) {
			for _, entry := range strings.Fields(v) {
				p, optional := strings.CutPrefix(entry, "-")
				p = strings.TrimPrefix(p, "+")
				if optional {
					continue
				}
				if reason := checkExists(root, p, provided, true); reason != "" {
					add(key, p, reason)
				}
			}
		}
	}

	for _, v := range u.Values("Service", "WorkingDirectory") {
		p, optional := strings.CutPrefix(v, "-")
		if optional || p == "~" {
			continue
		}
		if reason := checkExists(root, p, provided, true); reason != "" {
			add("WorkingDirectory", p, reason)
		}
	}

	for section, keys := range dependencyKeys {
		for _, key := range keys {
			for _, v := range u.Values(section, key) {
				for _, dep := range strings.Fields(v) {
					if builtinUnit(dep) {
						continue
					}
					if _, err := LoadUnit(root, dep); errors.Is(err, ErrUnitNotFound) {
						add(key, dep, "no such unit in the tree")
					} else if err != nil {
						return nil, err
					}
				}
			}
		}
	}
	sort.Slice(problems, func(i, j int) bool { return problems[i].String() < problems[j].String() })
	return problems, nil
}

// builtinUnit reports whether systemd synthesizes the unit at run time, so that no file defines it.
func builtinUnit(name string) bool {
	switch name {
	case "-.slice", "-.mount", "init.scope":
		return true
	}
	return strings.HasSuffix(name, ".device") || strings.HasSuffix(name, ".scope")
}

// commandPath returns the executable of an Exec*= value: the first word without systemd's
// prefixes (@ - : + ! |) and without quotes.
func commandPath(v string) string {
	v = strings.TrimLeft(strings.TrimSpace(v), "@-:+!|")
	fields := strings.Fields(v)
	if len(fields) == 0 {
		return ""
	}
	return strings.Trim(fields[0], `"'`)
}

// checkExecutable returns why cmd is not an executable regular file in the tree, or "".
func checkExecutable(root, cmd string) string {
	candidates := []string{cmd}
	if !path.IsAbs(cmd) {
		candidates = candidates[:0]
		for _, dir := range execSearchPath {
			candidates = append(candidates, path.Join(dir, cmd))
		}
	}
	for _, c := range candidates {
		fi, err := statIn(root, c)
		if err != nil {
			continue
		}
		if !fi.Mode().IsRegular() {
			return "not a regular file"
		}
		if fi.Mode().Perm()&0o111 == 0 {
			return "not executable"
		}
		return ""
	}
	return "missing from the tree"
}

// checkExists returns why p does not exist in the tree (and is not created at run time), or "".
func checkExists(root, p string, provided map[string]bool, dirOK bool) string {
	if !path.IsAbs(p) {
		return "not an absolute path"
	}
	if provided[path.Clean(p)] || kernelProvided(p) {
		return ""
	}
	fi, err := statIn(root, p)
	if err != nil {
		if underRun(p) {
			return "missing: /run is empty in the tree and nothing (RuntimeDirectory=, tmpfiles.d) creates it at run time"
		}
		return "missing from the tree"
	}
	if !dirOK && fi.IsDir() {
		return "is a directory"
	}
	return ""
}

// kernelProvided reports whether p lies in an API file system (/proc, /sys, /dev) that the kernel
// fills at run time: the tree has only empty mount points there, so such paths cannot be checked.
func kernelProvided(p string) bool {
	p = path.Clean(p)
	for _, fs := range []string{"/proc", "/sys", "/dev"} {
		if p == fs || strings.HasPrefix(p, fs+"/") {
			return true
		}
	}
	return false
}

func underRun(p string) bool {
	p = path.Clean(p)
	return p == "/run" || strings.HasPrefix(p, "/run/") || strings.HasPrefix(p, "/var/run/")
}

// runtimeProvided returns the paths that exist only at run time but are guaranteed for this unit:
// its RuntimeDirectory= and the directories and links tmpfiles.d creates under /run.
func runtimeProvided(u *Unit, tmpfiles []TmpfilesEntry) map[string]bool {
	out := map[string]bool{}
	for _, v := range u.Values("Service", "RuntimeDirectory") {
		for _, d := range strings.Fields(v) {
			d, _, _ = strings.Cut(d, ":")
			out[path.Join("/run", d)] = true
		}
	}
	for _, e := range tmpfiles {
		if underRun(e.Path) && strings.ContainsAny(e.Type[:1], "dDvqQLf") {
			out[path.Clean(e.Path)] = true
		}
	}
	return out
}

// checkEnvironmentFile reports variables named *_PATH in an environment file whose value is not an
// executable in the tree (such as BERTH_KUBEADM_PATH=/usr/bin/kubeadm).
func checkEnvironmentFile(root, unit, p string) ([]Problem, error) {
	vars, err := ReadEnvironmentFile(root, p)
	if err != nil {
		return nil, err
	}
	var problems []Problem
	for _, kv := range vars {
		if !strings.HasSuffix(kv[0], "_PATH") {
			continue
		}
		if reason := checkExecutable(root, kv[1]); reason != "" {
			problems = append(problems, Problem{Unit: unit, Key: "EnvironmentFile:" + kv[0], Value: kv[1], Reason: reason})
		}
	}
	return problems, nil
}

// ReadEnvironmentFile returns the NAME=value assignments of an environment file in the tree, in
// order, with surrounding quotes removed. It covers the subset of systemd's syntax the image uses:
// one assignment per line, comments starting with # or ;.
func ReadEnvironmentFile(root, p string) ([][2]string, error) {
	real, err := resolveIn(root, p)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", p, err)
	}
	data, err := os.ReadFile(real)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", p, err)
	}
	var out [][2]string
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, fmt.Errorf("parsing %s:%d: want NAME=value", p, i+1)
		}
		v = strings.TrimSpace(v)
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		out = append(out, [2]string{strings.TrimSpace(k), v})
	}
	return out, nil
}

// TmpfilesEntry is one line of a tmpfiles.d file.
type TmpfilesEntry struct {
	// File is the root-relative tmpfiles.d file the entry comes from.
	File string
	// Type is the entry's type with its modifiers, such as d, L or L+.
	Type string
	// Path is the path the entry manages.
	Path string
	// Argument is the last field (the link target for L), or "" for "-".
	Argument string
}

var tmpfilesDirs = []string{"/etc/tmpfiles.d", "/run/tmpfiles.d", "/usr/local/lib/tmpfiles.d", "/usr/lib/tmpfiles.d"}

// ReadTmpfiles returns the entries of every tmpfiles.d file in the tree, a file in a
// higher-priority directory hiding one of the same name in a lower one.
func ReadTmpfiles(root string) ([]TmpfilesEntry, error) {
	files := map[string]string{}
	for i := len(tmpfilesDirs) - 1; i >= 0; i-- {
		entries, err := readDirIn(root, tmpfilesDirs[i])
		if err != nil {
			return nil, err
		}
		for _, e := range entries {
			if strings.HasSuffix(e, ".conf") {
				files[e] = path.Join(tmpfilesDirs[i], e)
			}
		}
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	var out []TmpfilesEntry
	for _, n := range names {
		es, err := readTmpfilesFile(root, files[n])
		if err != nil {
			return nil, err
		}
		out = append(out, es...)
	}
	return out, nil
}

func readTmpfilesFile(root, p string) ([]TmpfilesEntry, error) {
	real, err := resolveIn(root, p)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", p, err)
	}
	data, err := os.ReadFile(real)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", p, err)
	}
	var out []TmpfilesEntry
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 2 {
			return nil, fmt.Errorf("parsing %s:%d: want at least type and path", p, i+1)
		}
		e := TmpfilesEntry{File: p, Type: f[0], Path: f[1]}
		if len(f) >= 7 {
			e.Argument = strings.Join(f[6:], " ")
		}
		if e.Argument == "-" {
			e.Argument = ""
		}
		out = append(out, e)
	}
	return out, nil
}

// resolveIn resolves p inside the tree at root and returns the host path, following symbolic
// links as the booted system would: an absolute link target starts again at root, and ".." never
// leaves it.
func resolveIn(root, p string) (string, error) {
	const maxLinks = 40
	links := 0
	resolved := "/"
	rest := strings.Split(strings.TrimPrefix(path.Clean("/"+p), "/"), "/")
	for len(rest) > 0 {
		part := rest[0]
		rest = rest[1:]
		switch part {
		case "", ".":
			continue
		case "..":
			resolved = path.Dir(resolved)
			continue
		}
		next := path.Join(resolved, part)
		fi, err := os.Lstat(filepath.Join(root, filepath.FromSlash(next)))
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			resolved = next
			continue
		}
		links++
		if links > maxLinks {
			return "", fmt.Errorf("resolving %s: too many levels of symbolic links", p)
		}
		target, err := os.Readlink(filepath.Join(root, filepath.FromSlash(next)))
		if err != nil {
			return "", err
		}
		if path.IsAbs(target) {
			resolved = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	return filepath.Join(root, filepath.FromSlash(resolved)), nil
}

// statIn stats p inside the tree at root, following links within the tree.
func statIn(root, p string) (fs.FileInfo, error) {
	real, err := resolveIn(root, p)
	if err != nil {
		return nil, err
	}
	return os.Stat(real)
}

// readDirIn lists the names in directory p of the tree; a missing directory is empty.
func readDirIn(root, p string) ([]string, error) {
	real, err := resolveIn(root, p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", p, err)
	}
	entries, err := os.ReadDir(real)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", p, err)
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names, nil
}

var presetDirs = []string{"/etc/systemd/system-preset", "/run/systemd/system-preset", "/usr/local/lib/systemd/system-preset", "/usr/lib/systemd/system-preset"}

// Preset returns what systemd's presets in the tree say about a unit, "enable" or "disable", as
// systemd applies them on a first boot: preset files from every preset directory (one in a
// higher-priority directory hiding one of the same name in a lower one), in file name order; the
// first line whose pattern matches the unit decides; no match means enable.
func Preset(root, unit string) (string, error) {
	files := map[string]string{}
	for i := len(presetDirs) - 1; i >= 0; i-- {
		entries, err := readDirIn(root, presetDirs[i])
		if err != nil {
			return "", err
		}
		for _, e := range entries {
			if strings.HasSuffix(e, ".preset") {
				files[e] = path.Join(presetDirs[i], e)
			}
		}
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		real, err := resolveIn(root, files[n])
		if err != nil {
			return "", fmt.Errorf("reading %s: %w", files[n], err)
		}
		data, err := os.ReadFile(real)
		if err != nil {
			return "", fmt.Errorf("reading %s: %w", files[n], err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 || strings.HasPrefix(f[0], "#") || strings.HasPrefix(f[0], ";") {
				continue
			}
			matched, err := path.Match(f[1], unit)
			if err != nil {
				return "", fmt.Errorf("parsing %s: pattern %q: %w", files[n], f[1], err)
			}
			if !matched {
				continue
			}
			switch f[0] {
			case "enable", "disable":
				return f[0], nil
			case "ignore":
				return "disable", nil
			}
		}
	}
	return "enable", nil
}

// mountNamespaceLists are the list settings that make systemd run a service in a mount namespace of
// its own whenever they are not empty (systemd.exec(5); exec_needs_mount_namespace in systemd).
var mountNamespaceLists = []string{
	"ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
	"BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem", "MountImages", "ExtensionImages",
	"ExtensionDirectories",
}

// mountNamespaceSettings are the single-valued settings that make systemd run a service in a mount
// namespace of its own, each with the values that do not.
var mountNamespaceSettings = map[string][]string{
	"RootDirectory":         {""},
	"RootImage":             {""},
	"PrivateTmp":            falseValues,
	"PrivateDevices":        falseValues,
	"PrivateMounts":         falseValues,
	"PrivateNetwork":        falseValues, // PrivateMounts= defaults to on with a network namespace
	"NetworkNamespacePath":  {""},
	"PrivateIPC":            falseValues,
	"IPCNamespacePath":      {""},
	"DynamicUser":           falseValues, // implies ProtectSystem=strict and PrivateTmp=
	"ProtectSystem":         falseValues,
	"ProtectHome":           falseValues,
	"ProtectKernelTunables": falseValues,
	"ProtectKernelModules":  falseValues,
	"ProtectKernelLogs":     falseValues,
	"ProtectControlGroups":  falseValues,
	"ProtectProc":           {"", "default"},
	"ProcSubset":            {"", "all"},
	"LogNamespace":          {""},
	"MountFlags":            {"", "shared"},
}

// falseValues are systemd's spellings of a false boolean, and the empty assignment (the default).
var falseValues = []string{"", "0", "no", "n", "false", "f", "off"}

// MountNamespaceOptions returns the [Service] settings of u that make systemd start the service in
// a mount namespace of its own ("Key=value", sorted), in which the mounts the service makes are not
// seen by the rest of the node.
func MountNamespaceOptions(u *Unit) []string {
	var out []string
	for _, key := range mountNamespaceLists {
		for _, v := range u.Values("Service", key) {
			out = append(out, key+"="+v)
		}
	}
	for key, harmless := range mountNamespaceSettings {
		vs := u.Values("Service", key)
		if len(vs) == 0 {
			continue
		}
		v := vs[len(vs)-1] // the last assignment wins
		if !slices.Contains(harmless, strings.ToLower(strings.TrimSpace(v))) {
			out = append(out, key+"="+v)
		}
	}
	sort.Strings(out)
	return out
}

// OrderedAfter reports whether u starts only after dep started successfully: dep is in its After=
// and in its Requires= or BindsTo= (a dependency without the ordering would start both at once).
func OrderedAfter(u *Unit, dep string) bool {
	listed := func(key string) bool {
		return slices.Contains(strings.Fields(strings.Join(u.Values("Unit", key), " ")), dep)
	}
	return listed("After") && (listed("Requires") || listed("BindsTo"))
}
